#!/usr/bin/env bash
# Regenerate api_pb2.py and api_pb2_grpc.py from api.proto (needs grpcio-tools).
# The generated gRPC module imports `api_pb2` as a top-level module; k8s/ is installed as
# gpemu.k8s, so rewrite that import to the package path.
set -euo pipefail
cd "$(dirname "$0")"
python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. api.proto
sed -i 's/^import api_pb2 as api__pb2$/from gpemu.k8s import api_pb2 as api__pb2/' api_pb2_grpc.py
grep -q '^from gpemu.k8s import api_pb2 as api__pb2$' api_pb2_grpc.py
echo "regenerated api_pb2.py and api_pb2_grpc.py"
