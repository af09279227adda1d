"""The engine tests' tiny checkpoints and single-thread setting, for these tests too."""
from tests.engine.conftest import model_dir, one_thread  # noqa: F401  (fixtures)


def assert_proposer_state_dropped(llm) -> None:
    """The runner and its proposer keep nothing for requests that left (the
    in-process executor: the rank is here to look at)."""
    runner = llm.engine.executor.worker.runner
    assert not runner._draft_probs
    assert not getattr(runner.proposer, "_tokens", {}), "the n-gram proposer kept token buffers"
