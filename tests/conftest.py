import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when a function is decorated, including its own standard library
# (tl.sum, tl.maximum, ...) on first import. Whichever test imports triton first would fix the mode
# for the whole session, so it is fixed here, before any test runs: interpreted on a machine without
# CUDA (the kernels then run on CPU tensors), compiled where CUDA is present (tests/gpu).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).parent))
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    from transformers.utils import logging

    logging.set_verbosity_error()
    yield
