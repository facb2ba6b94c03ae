import contextlib
import pathlib
import sys

import pytest

# The processes these tests run are shared with the demo and the benchmarks: harness/.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from harness import BUILDS, Envoy, render_config, wait_at_version, wait_for  # noqa: E402
from harness.kvfeed import FeedServer, FeedState  # noqa: E402
from upstream import Worker  # noqa: E402


class Setup:
    """A fleet of upstream workers, a feed server and an Envoy running kvroute (build
    "wasm": kvroute.wasm; "native": the dynamic module)."""

    def __init__(self, n_workers=3, roles=None, filter_config=None, sync_config=None,
                 feed=True, concurrency=2, build="wasm"):
        self.build = build
        self.workers = [Worker() for _ in range(n_workers)]
        roles = roles or ["both"] * n_workers
        self.state = FeedState()
        self.state.set_workers([(w.id, r, True) for w, r in zip(self.workers, roles)])
        self.feed = FeedServer(self.state) if feed else None
        feed_port = self.feed.port if feed else _closed_port()
        fc = {"debug_header": "x-kvroute-debug"}
        fc.update(filter_config or {})
        cfg, lp, ap = render_config(self.workers, feed_port, fc, sync_config, build=build)
        self.envoy = Envoy(cfg, lp, ap, concurrency=concurrency)
        if feed:
            self.wait_synced()

    def wait_synced(self):
        """Until the sync service has applied the feed's current version."""
        wait_at_version(self.envoy, self.state.version)

    def by_id(self, wid):
        return next(w for w in self.workers if w.id == wid)

    def stop(self):
        self.envoy.stop()
        if self.feed:
            self.feed.stop()
        for w in self.workers:
            w.stop()


def _closed_port():
    from harness import free_port
    return free_port()


@pytest.fixture
def closing():
    """Registers what a test starts; stopped (or closed) in reverse order at its end."""
    items = []
    yield items.append
    for item in reversed(items):
        (item.stop if hasattr(item, "stop") else item.close)()


@pytest.fixture(params=sorted(BUILDS))
def build(request):
    """Every test that runs kvroute in a real Envoy runs once per build: the wasm filter and
    the native dynamic module (the same core, the same configuration)."""
    return request.param


@pytest.fixture
def setup(build):
    made = []

    def make(**kw):
        s = Setup(build=build, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        with contextlib.suppress(Exception):
            s.stop()
