"""Fixtures shared by several test modules, and the `launch` marker kept exact.

`-m "not launch"` must skip exactly the tests that run a recipe (`launch.py`'s helpers: launched, in a
process of its own, on gloo ranks, or its `main` in this process), themselves or through their fixtures:
an unmarked test that runs one fails before it does, and a marked test that ran none, nor any fixture it
uses, fails at its end.
"""

import os
import shutil
import sys
from types import SimpleNamespace

# Nothing is fetched in the tests (CI reaches only package registries): a name that is no local folder fails at once
# instead of after the hub client's retries (23 s for one in test_compose.py). Before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under `pytest -n 3` (README's command) three test processes share 2 cores: one OpenMP thread each, set before torch
# is imported so that launched ranks and forked ones inherit it. Two threads each would spin against each other (a file
# that takes 3 minutes alone ran past 15), where one thread costs a test file under 10% alone. A third worker fills
# the cores while the others start processes or wait on a rank: the cores idle 1% of the run, which took 0.88 of two
# workers' time on the same machine.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
from filelock import FileLock

import launch
from gloo import start_rank_server
from helpers import make_checkpointer
from launch import REPO
from mmrecipes.contrastive.arguments import ModelArgs
from mmrecipes.contrastive.models import build_contrastive
from mmrecipes.loader import batches_forever

sys.path.insert(0, str(REPO / "data_prep"))
import tiny_vlm  # noqa: E402
import tiny_vlm_2026  # noqa: E402

_running = {"item": None, "fixtures": [], "launched": set()}  # the test, the fixtures being set up, who launched


def _counted(function):
    def launching(*args, **kwargs):
        item = _running["item"]
        if item is not None:
            if item.get_closest_marker("launch") is None:
                raise AssertionError(f"{item.nodeid} starts a recipe: mark it @pytest.mark.launch")
            _running["launched"].add(_running["fixtures"][-1] if _running["fixtures"] else item.nodeid)
        return function(*args, **kwargs)
    return launching


launch._run = _counted(launch._run)
launch._in_process = _counted(launch._in_process)
launch._on_ranks = _counted(launch._on_ranks)
launch._forked = _counted(launch._forked)
launch.launch_command = _counted(launch.launch_command)


def pytest_runtest_setup(item):
    _running["item"] = item


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    _running["fixtures"].append(fixturedef.argname)
    try:
        yield
    finally:
        _running["fixtures"].pop()


@pytest.fixture(scope="session", autouse=True)
def _rank_server():
    """The fork server started with what ranks import (gloo.RANK_PRELOAD), before an in-process run's
    DataLoader workers could start it without."""
    start_rank_server()


@pytest.fixture(autouse=True)
def _launch_marker_is_exact(request):
    yield
    node = request.node
    launched = node.nodeid in _running["launched"] or any(name in _running["launched"] for name in node.fixturenames)
    if node.get_closest_marker("launch") is not None and not launched:
        raise AssertionError(f"{node.nodeid} is marked launch but starts no recipe: drop the marker")


@pytest.fixture(scope="session")
def tiny_vlms(tmp_path_factory):
    """Every tiny family checkpoint (data_prep/tiny_vlm.py, tiny_vlm_2026.py), saved once per run, read by every
    pytest worker (under xdist their base folders share a parent): {family: directory}. No test writes into them."""
    shared = "PYTEST_XDIST_WORKER" in os.environ
    root = tmp_path_factory.getbasetemp().parent / "tiny_vlms" if shared else tmp_path_factory.mktemp("tiny_vlms")
    families = tiny_vlm.FAMILIES | tiny_vlm_2026.FAMILIES
    with FileLock(f"{root}.lock"):  # the first worker saves them, the other waits for it
        if not (root / "saved").exists():
            for family in families:
                tiny_vlm.save_family(families, family, root / family)
            (root / "saved").touch()
    return {family: root / family for family in families}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A single-process run of a small model over the embedded training stream, checkpointed after steps 2
    and 4 (as the recipes do), and the batches a straight run reads after step 4."""
    output_dir = tmp_path_factory.mktemp("run")
    model, tokenizer, image_processor = build_contrastive(ModelArgs())
    run = make_checkpointer(output_dir, model, tokenizer, image_processor)
    _, resumed_epoch = run.checkpoints.open_run(None, run.loader)
    batches = batches_forever(run.loader, resumed_epoch)
    for step in range(1, 5):
        epoch, _ = next(batches)
        run.optimizer.step()
        run.scheduler.step()
        if step % 2 == 0:
            run.checkpoints.save(step, epoch)
    after = [next(batches)[1]["input_ids"] for _ in range(2)]
    run.checkpoints.lock.release()
    return SimpleNamespace(root=output_dir, model=model, tokenizer=tokenizer, image_processor=image_processor,
                           after=after)


@pytest.fixture
def run(saved, tmp_path):
    """A copy of the saved run's checkpoints, and a Checkpointer of the same run over it."""
    shutil.copytree(saved.root / "checkpoints", tmp_path / "checkpoints")
    return make_checkpointer(tmp_path, saved.model, saved.tokenizer, saved.image_processor)
