"""Test-session setup shared by every test module.

Triton decides at `@triton.jit` time whether a kernel runs compiled or in its CPU
interpreter, from TRITON_INTERPRET. It must therefore be set before any test module
imports flashwatch's Triton kernels; pytest imports this file first. setdefault keeps an
explicit TRITON_INTERPRET=0 (benchmarks/gpu_check.py runs the same tests natively).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def one_thread():
    """torch on one thread for the test: the signal and policy tests run many tiny ops,
    several times faster on 1 thread than on 2 of a loaded 2-core machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test: the torch.compile tests count
    frames and recompiles, which another test's compiled code would change."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    """A watcher that measures sets Dynamo's process-wide force_eager stance until its
    step ends or it is removed or collected. One left behind by a test would make every
    later torch.compile test compile nothing (a head-mode recompile test saw 0 frames),
    so a test that leaves it after its watchers are gone fails here, and the stance is
    reset for the next test. Outermost teardown wrapper (tryfirst): it runs after every
    fixture's teardown. A test whose watcher logged an error calls remove() itself: the
    logged traceback's frames keep the test's locals, the watcher among them, alive."""
    result = yield
    from torch._dynamo import eval_frame

    if eval_frame._stance.stance != "default":
        import gc

        gc.collect()  # watchers the test dropped give the stance back when collected
        left = eval_frame._stance.stance
        if left != "default":
            from flashwatch.monitor import attach

            eval_frame._set_stance(eval_frame.DynamoStance("default"))
            attach._MEASURING.clear()
            attach._PRIOR_STANCE[0] = None
            pytest.fail(f"{item.nodeid} left Dynamo's stance at {left!r} (a watcher still "
                        f"measuring and not removed)")
    return result


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """flashwatch built (sdist, then a wheel from it) and installed into a throwaway venv
    once per session (tests/_installed.py)."""
    from _installed import install

    return install(tmp_path_factory.mktemp("installed"))
