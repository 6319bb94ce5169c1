"""runtime.comm.mesh.per_world: groups made under one default process group are made again under
the next (a dry run destroys its fake group and the next one makes another, which may reuse the
destroyed one's id(): the cache holds the group itself and compares it by identity)."""
from types import SimpleNamespace

from runtime.comm import mesh
from runtime.comm.mesh import per_world


def test_made_once_per_default_group_and_again_under_the_next(monkeypatch):
    made, cache = [], {}

    def make():
        made.append(object())
        return made[-1]
    first, second = object(), object()
    monkeypatch.setattr(mesh, "dist", SimpleNamespace(group=SimpleNamespace(WORLD=first)))
    a = per_world(cache, "mesh", make)
    assert per_world(cache, "mesh", make) is a and len(made) == 1
    monkeypatch.setattr(mesh, "dist", SimpleNamespace(group=SimpleNamespace(WORLD=second)))
    b = per_world(cache, "mesh", make)
    assert b is not a and len(made) == 2
    assert per_world(cache, "other", make) is made[-1] and len(made) == 3
