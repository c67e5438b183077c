from . import benchmarks, models  # noqa: F401
