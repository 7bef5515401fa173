"""tests/hf needs transformers and datasets (the dev extra); without them the package is skipped."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
