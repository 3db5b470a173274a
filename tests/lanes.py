"""How pytest-xdist deals the suite's files to its workers (``tests/conftest.py``'s
``pytest_xdist_make_scheduler``): each file whole on one worker, as ``--dist loadfile`` does, and
with three workers or more the last one is a lane of its own for the files that mostly wait (their
Slurm jobs are slowed on purpose until the test signals, cancels or requeues them). Those files
then no longer hold one of the two workers that compute while a core sits idle. The lane ends when
its files are done, so no more than two workers compute at a time; where one kind of worker is
gone, the others take its files."""

from pathlib import Path

from xdist.scheduler import LoadFileScheduling

WAITING = {"test_slurm_hosts.py", "test_slurm.py"}


class WaitingLane(LoadFileScheduling):
    def _lane(self, node) -> bool:
        return node.gateway.id == f"gw{self.numnodes - 1}"

    def _assign_work_unit(self, node) -> None:
        if not self.workqueue:
            return
        lane = self._lane(node)
        fits = [scope for scope in self.workqueue if (Path(scope).name in WAITING) == lane]
        if not fits:
            if any(self._lane(n) != lane and not n.shutting_down for n in self.nodes):
                if lane:
                    node.shutdown()        # the waiting files are done: no third worker computes
                return                     # their files wait for their own workers
            fits = list(self.workqueue)
        work_unit = self.workqueue.pop(fits[0])
        self.assigned_work.setdefault(node, {})[fits[0]] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])
