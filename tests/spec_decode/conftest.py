"""The engine tests' tiny checkpoints and single-thread setting, for these tests too."""
from tests.engine.conftest import model_dir, one_thread  # noqa: F401  (fixtures)
