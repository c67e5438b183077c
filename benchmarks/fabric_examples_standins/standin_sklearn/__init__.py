"""Stand-in for scikit-learn: `model_selection.KFold` only (see ../README.md)."""

from . import model_selection  # noqa: F401
