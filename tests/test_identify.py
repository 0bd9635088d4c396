"""Model identification against the real profile database, and examples/tvmodels fidelity."""

from __future__ import annotations

import csv
import gc
import io
from importlib import resources

import pytest
import torch
from torch import nn

from examples import tvmodels
from gpemu.config import EmuConfig
from gpemu.identify import identify, structural_fingerprint
from gpemu.runtime import Runtime


@pytest.fixture(scope="module")
def db():
    from gpemu.db import open_profile_db

    d = open_profile_db(EmuConfig.from_env())
    d.gpus()  # load names
    return d


def make_rt(db, **settings) -> Runtime:
    cfg = EmuConfig.from_env(**settings)
    return Runtime(config=cfg, db=db, gpus=[db.gpu(g) for g in cfg.gpus_per_device])


def meta_model(name: str, **kw) -> nn.Module:
    with torch.device("meta"):
        return tvmodels.MODELS[name](**kw)


@pytest.mark.slow
def test_tvmodels_match_torchvision_class_and_parameter_count():
    """examples/tvmodels/ builds torchvision's architectures: the class names, parameter counts and
    buffer sizes of the shipped model facts (db/data/models.csv, made with torchvision itself)."""
    text = resources.files("gpemu.db").joinpath("data", "models.csv").read_text()
    rows = {r["model"]: r for r in csv.DictReader(io.StringIO(text))}
    assert len(rows) == len(tvmodels.MODELS) == 36
    for name in tvmodels.MODELS:
        m = meta_model(name)
        assert type(m).__name__ == rows[name]["class"], name
        assert sum(p.numel() for p in m.parameters()) == int(rows[name]["params"]), name
        assert sum(b.numel() * b.element_size() for b in m.buffers()) == int(rows[name]["buffer_bytes"]), name


@pytest.mark.parametrize(
    "name",
    [
        "alexnet",
        "resnet18",
        "resnet50",
        "vgg16",
        "mobilenet_v2",
        "squeezenet1_1",
        "densenet121",
        "shufflenet_v2_x1_0",
        "mnasnet1_0",
        "mobilenet_v3_large",
        "googlenet",
    ],
)
def test_dataset_architectures_are_identified_by_structure(db, name):
    rt = make_rt(db)
    ident = identify(rt, meta_model(name))
    assert (ident.name, ident.source) == (name, "fingerprint")
    assert ident.info is not None and ident.info.param_count == ident.param_count


def test_replaced_head_still_identified(db):
    rt = make_rt(db)
    ident = identify(rt, meta_model("resnet50", num_classes=10))
    assert (ident.name, ident.source) == ("resnet50", "fingerprint")
    # ResNet-18 vs ResNet-34 with a 10-class head: still told apart
    assert identify(rt, meta_model("resnet34", num_classes=10)).name == "resnet34"


def test_model_matching_nothing_is_estimated_and_said_once(db, capsys):
    rt = make_rt(db)

    class TinyNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 4)

    m = TinyNet()
    ident = identify(rt, m)
    assert ident.name is None and ident.source == "estimated" and ident.param_count == 32 * 64 + 64 + 64 * 4 + 4
    identify(rt, TinyNet())
    err = capsys.readouterr().err
    assert err.count("matches no dataset model") == 1


def test_configured_model_goes_to_the_first_parameterised_module_only(db):
    rt = make_rt(db, model="vgg16")
    loss = nn.CrossEntropyLoss()  # no parameters: never takes the configured model's time
    assert identify(rt, loss).source == "estimated"
    user = nn.Sequential(nn.Linear(8, 8))
    ident = identify(rt, user)
    assert (ident.name, ident.source) == ("vgg16", "configured")
    other = nn.Linear(4, 4)
    assert identify(rt, other).source == "estimated"


def test_unknown_configured_model_is_a_clear_error(db):
    from gpemu.db import UnknownNameError

    rt = make_rt(db, model="resnet5O")
    with pytest.raises(UnknownNameError, match="resnet50"):
        identify(rt, nn.Linear(2, 2))


def test_wrapper_is_identified_by_its_outermost_identified_submodules(db):
    rt = make_rt(db)

    class TwoTower(nn.Module):
        def __init__(self):
            super().__init__()
            self.left = tvmodels.resnet18()
            self.right = nn.Sequential(tvmodels.alexnet(), nn.Linear(1000, 2))

    with torch.device("meta"):
        m = TwoTower()
    ident = identify(rt, m)
    assert ident.name == "resnet18+alexnet" and len(ident.parts) == 2
    # the submodule itself is cached with its own identity
    assert identify(rt, m.left) is ident.parts[0]


def test_identity_cached_per_module_object_weakly(db):
    rt = make_rt(db)
    m = meta_model("resnet18")
    assert identify(rt, m) is identify(rt, m)
    cache = rt.identities.cache
    assert len(cache) == 1
    del m
    gc.collect()
    assert len(cache) == 0


def test_fingerprint_depends_on_structure_not_values_or_device():
    a, b = tvmodels.resnet18(), meta_model("resnet18")
    assert structural_fingerprint(a) == structural_fingerprint(b)
    assert structural_fingerprint(a) != structural_fingerprint(tvmodels.resnet18(num_classes=10))


def test_database_fingerprint_disambiguates(db):
    """When the database holds a fingerprint, a structure differing in layout is not matched."""
    from gpemu.db import ModelInfo

    rt = make_rt(db)

    class Odd(nn.Module):  # same class name/param count as a fake dataset entry
        def __init__(self):
            super().__init__()
            self.x = nn.Linear(10, 10)

    odd = Odd()
    info = ModelInfo(
        name="odd_model",
        class_name="Odd",
        param_count=110,
        param_bytes=440,
        buffer_bytes=0,
        fwd_flops_per_sample=200,
        fwd_bwd_flops_per_sample=600,
        fingerprint="0000",
    )

    class DBView:  # the real db plus one extra structure row
        def __getattr__(self, n):
            return getattr(db, n)

        def models_by_structure(self, cls, count):
            return [info] if (cls, count) == ("Odd", 110) else db.models_by_structure(cls, count)

    rt.db = DBView()
    assert identify(rt, odd).source == "estimated"
    rt2 = make_rt(db)
    rt2.db = DBView()
    info2 = ModelInfo(**{**info.__dict__, "fingerprint": structural_fingerprint(odd)})
    DBView.models_by_structure = lambda self, c, n: [info2] if (c, n) == ("Odd", 110) else []
    assert identify(rt2, Odd()).name == "odd_model"
