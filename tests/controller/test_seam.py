"""The seam between the user API and its controller is typed (controller/seam.py).

Both the real Controller and the dry run's stand-in satisfy the Protocol, and
every name the user API calls on a controller is in it: a new call on one side
that the Protocol does not name fails here, not in a dry run in a user's hands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import dask_monarch as dm
from dask_monarch.controller import Controller
from dask_monarch.controller.dry import DryController
from dask_monarch.controller.seam import ControllerSeam, Substitute

PACKAGE = Path(dm.__file__).parent
# the user API, and the controller-side modules that hold a Session's controller
USERS = [
    *sorted(PACKAGE.glob("*.py")),
    PACKAGE / "controller" / "session.py",
    PACKAGE / "controller" / "futures.py",
    PACKAGE / "controller" / "cancel.py",
]


def _names_called_on_a_controller() -> set[str]:
    """``x.controller.NAME`` and ``controller.NAME`` (a local bound to one) in USERS."""
    names = set()
    for path in USERS:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            held = (isinstance(owner, ast.Attribute) and owner.attr == "controller") or (
                isinstance(owner, ast.Name) and owner.id in ("controller", "real")
            )
            if held:
                names.add(node.attr)
    return names


def test_every_name_the_user_api_calls_on_a_controller_is_in_the_seam():
    named = {n for n in dir(ControllerSeam) if not n.startswith("_")}
    named |= set(ControllerSeam.__annotations__)
    used = _names_called_on_a_controller()
    assert used, "the scan found no call on a controller"
    assert used - named == set(), (
        f"called on a controller but not in ControllerSeam: {used - named}"
    )


def test_the_real_controller_and_the_dry_run_stand_in_satisfy_it(client2):
    controller = Controller(client2, world_size=2)
    try:
        assert isinstance(controller, ControllerSeam)
        stand_in = DryController(controller, first_id=1 << 40, futures={})
        assert isinstance(stand_in, Substitute)
        assert stand_in.client is controller.client
    finally:
        controller.close()


def test_a_dry_run_leaves_the_session_and_tensor_class_as_they_were(mesh2):
    session = mesh2._session
    new = dm.Tensor.__dict__["__new__"]
    real = session.controller
    with mesh2.activate():
        before = torch.ones(2)
        with dm.dry_run(mesh2) as run:
            assert session.controller is not real
            torch.ones(2) * before
        assert session.controller is real and dm.Tensor.__dict__["__new__"] is new
        assert session.watch is None
        assert dm.inspect(before + 1).tolist() == [2.0, 2.0]
    assert run.messages > 0
