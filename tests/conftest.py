import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    from transformers.utils import logging

    logging.set_verbosity_error()
    yield
