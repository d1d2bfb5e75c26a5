import pytest
import torch

# The tests use tiny tensors: more than one intra-op thread only adds synchronisation, and on a shared 2-core machine
# it turns milliseconds into seconds.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
