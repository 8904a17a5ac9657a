PY ?= python
# pytest-xdist workers for `make test` (JOBS=1: one worker process)
JOBS ?= $(shell nproc)
.PHONY: compile test test-python bench proto lint clean

compile:
	$(PY) setup.py build_ext --inplace

test: compile
	$(PY) -m pytest -q -n $(JOBS) --dist worksteal
	DENSEDEV_NO_EXTENSIONS=1 $(PY) -m pytest -q -n $(JOBS) --dist worksteal

bench: compile
	$(PY) bench/run_all.py $(BENCHFLAGS)

proto:
	cd src/densedev/_proto && $(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. api.proto podresources.proto \
		pluginregistration.proto dra_v1.proto dra_v1beta1.proto dra_health_v1alpha1.proto
	sed -i 's/^import api_pb2 as api__pb2/from . import api_pb2 as api__pb2/' src/densedev/_proto/api_pb2_grpc.py
	sed -i 's/^import podresources_pb2 as podresources__pb2/from . import podresources_pb2 as podresources__pb2/' src/densedev/_proto/podresources_pb2_grpc.py
	for m in pluginregistration dra_v1 dra_v1beta1 dra_health_v1alpha1; do \
		sed -i "s/^import $${m}_pb2 as /from . import $${m}_pb2 as /" src/densedev/_proto/$${m}_pb2_grpc.py; done

lint:
	$(PY) -m ruff check src tests bench .ci
	$(PY) -m ruff format --check src tests bench .ci
	$(PY) -m mypy
	$(PY) -m mypy .ci/image_check.py

clean:
	rm -rf build src/densedev/*.so src/densedev/_fast.c
