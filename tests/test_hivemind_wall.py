"""hivemind's internals stay behind one wall (dtrain/swarm/hivemind_internals/).

* the shims are installed, and only a tested hivemind release is accepted, with the fix named;
* pyproject.toml asks for exactly the tested releases;
* no dtrain module outside the wall subclasses a hivemind class, imports or reads a private
  hivemind name, reaches into hivemind's internal objects, or patches hivemind (an AST scan,
  with a self-test that it catches each kind of violation);
* the averager's RPC names on the wire are the ones every release used.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import hivemind
import pytest

from dtrain.swarm import library

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
WALL = REPO / "dtrain" / "swarm" / "hivemind_internals"
HIVEMIND_SRC = Path(hivemind.__file__).resolve().parent

# Public attributes of hivemind's objects that are its internals all the same (matchmaking and
# all-reduce state, the load balancer's LP, the key manager's store): reached only by the wall.
INTERNAL_NAMES = {
    "current_followers", "leader_assemble_group", "lock_request_join_group", "assembled_group", "step_control",
    "group_key_manager", "declare_averager", "optimize_parts_lp", "load_balance_peers", "register_processed_part",
    "return_deltas", "tensor_part_container", "tensor_part_reducer", "parts_for_local_averaging",
}
# hivemind's private names that dtrain also defines for itself (so the scan cannot tell them apart by
# name) but never on these hivemind objects: a private attribute of ``x.p2p`` and the like is hivemind's.
HIVEMIND_OBJECTS = {"p2p", "dht", "protocol", "routing_table", "averager", "runner", "matchmaking"}
# Modules that hold dtrain's rules and must not import hivemind at all.
PURE = ["dtrain/swarm/averaging/group_rules.py", "dtrain/swarm/averaging/reducer.py",
        "dtrain/swarm/averaging/settings.py", "dtrain/swarm/codecs.py", "dtrain/swarm/library.py",
        "dtrain/swarm/averaging/assembly.py", "dtrain/swarm/averaging/centered_clip.py",
        "dtrain/swarm/averaging/norms.py"]


# -- the scanner -------------------------------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_names(tree: ast.AST) -> set[str]:
    """Names a source defines itself: functions, classes, assignment targets (also ``self.x = ...``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        out.add(sub.id)
                    elif isinstance(sub, ast.Attribute):
                        out.add(sub.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return out


def hivemind_private_names() -> set[str]:
    names = set()
    for path in HIVEMIND_SRC.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except SyntaxError:
            continue
        names |= {n for n in _defined_names(tree) if _private(n)}
    return names


def _root(node: ast.AST):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def scan(source: str, hivemind_private: set[str], own: set[str]) -> list[str]:
    """What a dtrain module (outside the wall) does that only the wall may do."""
    tree = ast.parse(source)
    problems = []
    bound = set()  # local names bound to hivemind modules or objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hivemind":
                    if any(_private(part) for part in alias.name.split(".")):
                        problems.append(f"line {node.lineno}: imports private module {alias.name}")
                    bound.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hivemind":
            if any(_private(part) for part in node.module.split(".")):
                problems.append(f"line {node.lineno}: imports from private module {node.module}")
            for alias in node.names:
                if _private(alias.name):
                    problems.append(f"line {node.lineno}: imports private name {alias.name}")
                bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if _root(base) in bound:
                    problems.append(f"line {node.lineno}: class {node.name} subclasses hivemind's {ast.unparse(base)}")
        elif isinstance(node, ast.Attribute):
            if node.attr in INTERNAL_NAMES:
                problems.append(f"line {node.lineno}: reaches hivemind's internal .{node.attr}")
            elif _private(node.attr) and (_root(node) in bound or (node.attr in hivemind_private
                                                                    and node.attr not in own)
                                          or (isinstance(node.value, ast.Attribute)
                                              and node.value.attr in HIVEMIND_OBJECTS)):
                problems.append(f"line {node.lineno}: reads hivemind's private .{node.attr}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if isinstance(target, (ast.Attribute, ast.Subscript)) and _root(target) in bound:
                    problems.append(f"line {node.lineno}: patches hivemind ({ast.unparse(target)})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and _root(node.args[0]) in bound:
                problems.append(f"line {node.lineno}: patches hivemind ({ast.unparse(node)})")
    return problems


def _dtrain_sources() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in sorted((REPO / "dtrain").rglob("*.py"))
            if WALL not in p.parents}


@pytest.fixture(scope="module")
def names():
    own = set()
    for source in _dtrain_sources().values():
        own |= _defined_names(ast.parse(source))
    return hivemind_private_names(), own


def test_nothing_outside_the_wall_touches_hivemind_internals(names):
    hivemind_private, own = names
    found = {}
    for path, source in _dtrain_sources().items():
        problems = scan(source, hivemind_private, own)
        if problems:
            found[str(path.relative_to(REPO))] = problems
    assert not found, found


def test_the_scanner_catches_each_kind_of_violation(names):
    hivemind_private, own = names
    planted = {
        "subclass": "from hivemind.averaging import DecentralizedAverager\nclass A(DecentralizedAverager):\n    pass\n",
        "subclass via module": "import hivemind\nclass D(hivemind.DHT):\n    pass\n",
        "private import": "from hivemind.compression.serialization import _BASE_COMPRESSION_TYPES\n",
        "private module": "import hivemind.p2p._internal\n",
        "private attribute": "from hivemind.compression import serialization\n"
                             "x = serialization._BASE_COMPRESSION_TYPES\n",
        "private method": "async def f(runner, peer):\n    await runner._communicate_with_peer(peer)\n",
        "private client": "async def f(node, peer):\n    await node.p2p._client.connect(peer, [])\n",
        "internal state": "def f(mm):\n    return mm.current_followers\n",
        "monkeypatch": "from hivemind.averaging import load_balancing\nload_balancing.optimize_parts_lp = print\n",
        "setattr": "import hivemind\nsetattr(hivemind.DHT, 'run', print)\n",
    }
    for kind, source in planted.items():
        assert scan(source, hivemind_private, own), kind
    clean = ("from hivemind.p2p import PeerID\nfrom hivemind.utils.timed_storage import get_dht_time\n"
             "class Mine:\n    def __init__(self):\n        self._step = None\n"
             "def f(dht):\n    return PeerID.from_base58(str(dht.peer_id)), get_dht_time()\n")
    assert scan(clean, hivemind_private, own) == []


@pytest.mark.parametrize("path", PURE)
def test_the_rules_import_no_hivemind(path):
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        for module in modules:
            assert module.split(".")[0] != "hivemind", (path, node.lineno)
            assert "hivemind_internals" not in module, (path, node.lineno)


# -- shims and versions --------------------------------------------------------------------------


def test_the_shims_are_installed():
    from hivemind.averaging import load_balancing
    from hivemind.compression import serialization

    from dtrain.swarm import hivemind_internals as wall

    assert wall.shims_installed()
    assert load_balancing.optimize_parts_lp is wall.optimize_parts_highs
    registry = serialization._BASE_COMPRESSION_TYPES
    assert isinstance(registry["BLOCKWISE_8BIT"], wall.BlockwiseAbsmax8BitCompression)
    assert type(registry["MEANSTD_16BIT"]) is wall.BlockwiseTernaryCompression  # the id dtrain's ternary codec takes
    for key in ("UNIFORM_8BIT", "QUANTILE_8BIT"):
        assert getattr(type(registry[key]), "_dtrain_fixed", False), key


def test_the_installed_release_is_a_tested_one():
    assert library.version_problem() is None
    library.check_swarm_library()
    low, high = library.TESTED_VERSIONS
    assert low <= importlib.metadata.version("hivemind") <= high


def test_an_untested_release_is_named_with_the_supported_one_and_the_fix(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.2.0" if name == "hivemind" else real(name))
    problem = library.version_problem()
    assert problem and "1.2.0" in problem and "1.1.12" in problem and "pip install 'hivemind==1.1.12'" in problem
    with pytest.raises(library.UnsupportedHivemind, match="1.2.0"):
        library.check_swarm_library()
    assert issubclass(library.UnsupportedHivemind, ImportError)

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert "not installed" in library.version_problem()


@pytest.mark.parametrize("version,ok", [("1.1.12", True), ("1.1.12.post1", True), ("1.1.12+local", True),
                                        ("1.1.12rc1", False), ("1.1.12.dev0", False), ("1.1.11", False),
                                        ("1.1.13", False), ("2.0", False), ("garbage", False)])
def test_release_comparison(monkeypatch, version, ok):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    assert (library.version_problem() is None) == ok


def test_the_check_is_cheap_and_the_wall_refuses_an_untested_release():
    script = textwrap.dedent("""
        import importlib.metadata, sys
        from dtrain.swarm.library import UnsupportedHivemind, check_swarm_library, version_problem
        assert version_problem() is None and "hivemind" not in sys.modules and "torch" not in sys.modules
        importlib.metadata.version = lambda name: "9.9.9"
        try:
            import dtrain.swarm.hivemind_internals
        except UnsupportedHivemind as exc:
            assert "9.9.9" in str(exc) and "hivemind" not in sys.modules
            print("REFUSED")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "REFUSED", out.stderr[-2000:]


def test_pyproject_asks_for_the_tested_releases():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = [d.replace(" ", "") for d in deps if d.split("=")[0].split(">")[0].split("<")[0].strip() == "hivemind"]
    low, high = library.TESTED_VERSIONS
    assert wanted == ([f"hivemind=={low}"] if low == high else [f"hivemind>={low},<={high}"])


# -- the wire names ------------------------------------------------------------------------------


class _RecordingP2P:
    def __init__(self):
        self.names = []

    async def iterate_protobuf_handler(self, peer, handle_name, *args, **kwargs):
        self.names.append(handle_name)

    async def call_protobuf_handler(self, peer, handle_name, *args, **kwargs):
        self.names.append(handle_name)

    async def add_protobuf_handler(self, handle_name, *args, **kwargs):
        self.names.append(handle_name)


# hivemind's three, and dtrain's question between members after the butterfly (result_check.py)
RPCS = ("rpc_aggregate_part", "rpc_ask_member", "rpc_download_state", "rpc_join_group")


def _averager_classes():
    from dtrain.swarm.hivemind_internals import AveragerProcess

    return [AveragerProcess]  # dtrain's rules never subclass it (its round handler is composed in)


def test_the_rpc_names_on_the_wire_are_unchanged():
    from hivemind.averaging import DecentralizedAverager

    from dtrain.swarm.hivemind_internals import AVERAGER_WIRE_NAME

    assert AVERAGER_WIRE_NAME == "_DtrainAverager"
    expected = [f"ns::_DtrainAverager.{rpc}" for rpc in RPCS]
    # hivemind's own averager's stub first: its cached handlers must not leak into ours
    DecentralizedAverager.get_stub(_RecordingP2P(), None, namespace="ns")
    for cls in _averager_classes():
        assert [cls._get_handle_name("ns", rpc) for rpc in RPCS] == expected, cls
        p2p = _RecordingP2P()
        stub = cls.get_stub(p2p, None, namespace="ns")
        for rpc in RPCS:
            asyncio.run(getattr(stub, rpc)(None))
        assert sorted(p2p.names) == expected, cls
        served = _RecordingP2P()
        servicer = object.__new__(cls)  # handlers only: no process, no DHT
        servicer._parent_pid = None  # what hivemind's __del__ reads
        asyncio.run(servicer.add_p2p_handlers(served, namespace="ns"))
        assert sorted(served.names) == expected, cls


@pytest.mark.parametrize("argv", [["mine", "--no-dashboard"], ["validate", "--no-dashboard"],
                                  ["benchmark-bandwidth", "--local-peers", "2", "--json"]])
def test_a_command_on_an_untested_hivemind_stops_with_the_fix(argv, tmp_path):
    """`dtrain mine`/`validate`/`benchmark-bandwidth` refuse to start, exit 1, and say which
    releases work and how to get one (no traceback)."""
    script = textwrap.dedent(f"""
        import importlib.metadata, sys
        real = importlib.metadata.version
        importlib.metadata.version = lambda name: "1.2.0" if name == "hivemind" else real(name)
        from dtrain.cli.app import main
        sys.argv = ["dtrain", *{argv!r}, "--network", "sandbox", "--sandbox-dir", {str(tmp_path)!r}]
        main()
    """)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("DTRAIN_", "BT_"))}
    env["HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env=env)
    assert out.returncode == 1, (out.stdout[-2000:], out.stderr[-2000:])
    low, high = library.TESTED_VERSIONS
    assert "hivemind 1.2.0 is installed" in out.stderr and high in out.stderr
    assert f"pip install 'hivemind=={high}'" in out.stderr and "Traceback" not in out.stderr


def test_importing_the_rules_loads_no_hivemind():
    """The pure rule modules (and the settings the neurons build) load without hivemind,
    also through the package: a neuron on an untested hivemind can still read its config."""
    script = textwrap.dedent("""
        import sys
        import dtrain.swarm.averaging.group_rules, dtrain.swarm.averaging.settings
        import dtrain.swarm.averaging.assembly
        from dtrain.swarm.averaging import AveragingConfig, settings_from
        assert "hivemind" not in sys.modules, sorted(m for m in sys.modules if m.startswith("hivemind"))[:5]
        from dtrain.swarm.averaging import GradientSwarm
        assert "hivemind" in sys.modules and "dtrain.swarm.hivemind_internals" in sys.modules
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-2000:]
