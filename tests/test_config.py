"""EmuConfig: one object from defaults, environment and explicit settings."""

import pytest

from gpemu.config import ConfigError, EmuConfig


def test_defaults_then_env_then_overrides():
    env = {"GPEMU_GPU": "A100", "GPEMU_NUM_GPUS": "2", "GPEMU_REPLAY": "off"}
    cfg = EmuConfig.from_env(env)
    assert (cfg.gpu, cfg.num_gpus, cfg.replay) == ("A100", 2, False)
    cfg = EmuConfig.from_env(env, gpu="P100", num_gpus=None)  # None falls through to env
    assert (cfg.gpu, cfg.num_gpus) == ("P100", 2)
    assert EmuConfig.from_env({}).gpu == "V100"


def test_round_trip_through_environment():
    cfg = EmuConfig.from_env(
        {},
        gpu="K80",
        num_gpus=3,
        model="resnet50",
        trace_path="t.json",
        sharing="amqp://u:secret@localhost:5672/%2F",
        summary=False,
    )
    again = EmuConfig.from_env(cfg.to_env())
    assert again == cfg


def test_device_gpus_decide_the_count():
    cfg = EmuConfig.from_env({"GPEMU_GPUS": "V100, A100"})
    assert cfg.gpus_per_device == ("V100", "A100")
    assert cfg.num_gpus == 2


@pytest.mark.parametrize(
    "settings, fragment",
    [
        ({"num_gpus": 0}, "num_gpus must be an integer from 1 to 64"),
        ({"num_gpus": "two"}, "num_gpus must be an integer"),
        ({"memory": "magic"}, "memory must be one of tracked, profiled"),
        ({"replay": "maybe"}, "replay must be a boolean"),
        ({"sharing": "http://broker"}, "sharing must be an amqp://"),
        ({"colour": "red"}, "unknown setting 'colour'"),
    ],
)
def test_bad_settings_say_what_is_valid(settings, fragment):
    with pytest.raises(ConfigError, match=fragment):
        EmuConfig.from_env({}, **settings)


def test_credentials_never_in_description_or_errors():
    cfg = EmuConfig.from_env({}, sharing="amqp://guest:hunter2@host/")
    assert "hunter2" not in cfg.describe()
    with pytest.raises(ConfigError) as err:
        EmuConfig.from_env({}, sharing="http://guest:hunter2@host/")
    assert "hunter2" not in str(err.value)


def test_data_dir_from_xdg():
    cfg = EmuConfig.from_env({"XDG_DATA_HOME": "/tmp/xdg"})
    assert str(cfg.default_data_dir) == "/tmp/xdg/gpemu"
