"""What a Dask user sees on the dashboard while tilegraph trains (a dashboard audit): the
task-group graph draws between steps, the values sent to the workers carry tilegraph's names,
the task groups stay the same few however long the run, a runtime shows its dashboard as a link
in Jupyter, and Dask's own ``performance_report`` profiles a step. (The dashboard's port, its
address on 127.0.0.1 and ``dashboard=False``: tests/test_connect_dashboard.py and
tests/test_e2e42_nbmessages.py.)"""

from __future__ import annotations

import urllib.error
import urllib.request

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.runtime import VALUE_KEY_PREFIX
from tilegraph.runtime.worker_setup import prune_group_dependencies
from tilegraph.trainer import lm_loss


@pytest.fixture(scope="module")
def dashboard_runtime():
    """An embedded cluster of one worker with its dashboard on (a free port of 127.0.0.1)."""
    rt = tg.connect(n_workers=1, threads_per_worker=1, quiet=True, make_current=False)
    try:
        yield rt
    finally:
        rt.close()


def _trainer(rt, **options) -> tg.Trainer:
    model = models.build("gpt2-debug", seed=0)
    rng = np.random.default_rng(0)

    def data(step):
        ids = rng.integers(0, model.config.vocab_size, (2, 17))
        return ids[:, :-1], ids[:, 1:]

    optimizer = tg.optim.AdamW(model.parameters(), lr=1e-3)
    return tg.Trainer(model, optimizer, data, rt, batch_size=2, loss_fn=lm_loss, progress=False, **options)


def _groups(dask_scheduler) -> dict:
    """Each task group's name, with the names of its dependencies and whether each is a live group."""
    live = dask_scheduler.task_groups
    return {name: sorted((d.name, live.get(d.name) is d) for d in g.dependencies) for name, g in live.items()}


def _prefixes(dask_scheduler) -> tuple[list, list]:
    return sorted(dask_scheduler.task_prefixes), sorted(dask_scheduler.task_groups)


def _page(link: str, path: str) -> int:
    base = link.rsplit("/", 1)[0]
    try:
        with urllib.request.urlopen(base + path, timeout=30) as page:
            page.read()
            return page.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.distributed
def test_the_task_group_graph_draws_after_training_steps(dashboard_runtime):
    """Before: once a step's batch was forgotten, the step group still named the batch's group
    among its dependencies (Dask removes an emptied group but not the links to it), and the
    dashboard's task-group graph (/individual-groups, /groups) failed with "KeyError: 'ndarray'"
    on every refresh (HTTP 500, a blank page). Now every dependency is a live group and the page
    answers."""
    rt = dashboard_runtime
    _trainer(rt, steps_per_graph=1).fit(3)
    groups = rt.client.run_on_scheduler(_groups)
    assert any(deps for deps in groups.values()), groups  # (the step reads the programs, at least)
    assert all(live for deps in groups.values() for _, live in deps), groups
    assert _page(rt.dashboard_link, "/individual-groups") == 200


@pytest.mark.distributed
def test_the_values_sent_are_named_and_the_groups_stay_few(embedded_runtime):
    """Before: the parameters and batches sent to the workers were Dask's ``ndarray-<uuid>``
    keys, the one group on the dashboard that did not say it was tilegraph's. Now every task
    prefix is ``tg-...`` (the values ``tg-value``), and more steps add no prefix or group (the
    step is in no name; measured: 31 prefixes after 50 and after 200 steps, a task per part)."""
    rt = embedded_runtime
    before, _ = rt.client.run_on_scheduler(_prefixes)  # (the shared cluster ran other tests' tasks)
    trainer = _trainer(rt, fuse=False, steps_per_graph=1)
    trainer.fit(2)
    prefixes, _ = rt.client.run_on_scheduler(_prefixes)
    new = set(prefixes) - set(before)
    assert VALUE_KEY_PREFIX in prefixes and "ndarray" not in new, new
    assert all(p.startswith("tg-") for p in new), new
    cells = [c for p in tg.nn.Linear(3, 2, seed=0).parameters() for c in p.cells.flat]
    rt.scatter_cells(cells)  # (whatever other tests left on the shared cluster: these keys are ours)
    assert all(c.value.future.key.startswith(VALUE_KEY_PREFIX + "-") for c in cells), [c.value for c in cells]
    assert any(p.startswith("tg-blocks-") for p in prefixes), prefixes  # (a task per part of the model)
    trainer.fit(4)
    later, later_groups = rt.client.run_on_scheduler(_prefixes)
    assert later == prefixes  # (Dask keeps every prefix for good: one per step would pile up)
    assert set(later_groups) <= set(prefixes), later_groups  # (groups come and go with their tasks)


def test_stale_group_dependencies_are_pruned_and_live_ones_kept():
    """The pruning itself, on a scheduler's task groups: a dependency the scheduler no longer
    holds goes, and so does an object of a live group's name that is not that group (a group
    made anew under the name); the live ones stay."""
    class Group:  # (hashed by identity, as Dask's TaskGroup)
        def __init__(self, name, *deps):
            self.name, self.dependencies = name, set(deps)

    class Scheduler:
        def __init__(self, *groups):
            self.task_groups = {g.name: g for g in groups}

    group = Group
    values, programs = group("tg-value"), group("tg-program")
    old_values = group("tg-value")  # forgotten; a later batch made a group of that name again
    gone = group("ndarray")
    step = group("tg-fwd-bwd-update", values, old_values, programs, gone)
    scheduler = Scheduler(values, programs, step)
    assert prune_group_dependencies(scheduler) == 2
    assert step.dependencies == {values, programs}
    assert prune_group_dependencies(scheduler) == 0


@pytest.mark.distributed
def test_a_runtime_shows_its_dashboard_as_a_link_in_jupyter(dashboard_runtime, embedded_runtime):
    """Before: a Runtime had no ``_repr_html_``: Jupyter showed its text repr, whose dashboard
    address cannot be clicked (Dask's own Client shows a link). Now it shows the scheduler, the
    workers and the dashboard as a link; "off" for a cluster without one."""
    html = dashboard_runtime._repr_html_()
    link = dashboard_runtime.dashboard_link
    assert link.startswith("http://127.0.0.1:"), link
    assert f'<a href="{link}" target="_blank">{link}</a>' in html, html
    assert dashboard_runtime.address in html and "1 worker, 1 thread" in html, html
    assert "(embedded cluster)" in html, html
    off = embedded_runtime._repr_html_()  # (started with dashboard=False)
    assert "Dask dashboard: off" in off and "<a " not in off and "2 workers" in off, off


@pytest.mark.distributed
def test_a_closed_runtimes_html_says_closed():
    """A closed runtime's HTML says so, as its text repr does, and asks the scheduler nothing."""
    rt = tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False)
    rt.close()
    assert rt._repr_html_() == "<p><b>tilegraph.Runtime</b>: closed</p>"


@pytest.mark.distributed
def test_dasks_performance_report_profiles_a_training_step(dashboard_runtime, tmp_path):
    """A Dask user's own ``with performance_report(...)`` around ``fit`` (as the README now
    says): the report is written and its task stream names tilegraph's step task; the worker
    profiler stays off on the embedded cluster (the README says how to turn it on)."""
    from distributed import performance_report

    rt = dashboard_runtime
    trainer = _trainer(rt, steps_per_graph=1)
    trainer.fit(1)
    # (the report asks Dask's current client: in a notebook, the one cluster connected; here
    # another test's cluster may be newer)
    with rt.client.as_current(), performance_report(filename=str(tmp_path / "report.html")):
        trainer.fit(2)
    report = (tmp_path / "report.html").read_text()
    assert "tg-fwd-bwd-update" in report
    assert rt.client.run(lambda dask_worker: "profile" in dask_worker.periodic_callbacks) == \
        {a: False for a in rt.workers()}
