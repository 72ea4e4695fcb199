"""The house rules of the product tree, checked: small files and functions, no history in the
code, imports one way (no cycle, every module importable alone), the README a front door,
and the lab kept out of the tree."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvtier"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
HISTORY = re.compile(r"\b[Rr]uns? [0-9]+\b|\b[Ii]ssues? #?[0-9]+\b")


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_no_file_in_the_package_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"split these along a seam with a name: {long}"


def test_no_function_in_the_package_is_over_60_lines():
    long = []
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "name the steps of these: " + "; ".join(long)


def test_the_package_names_no_run_and_no_issue_number():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sources()
             for i, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, "docstrings state contracts; the story goes to docs/performance.md:\n" + "\n".join(found)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports, at module level or inside functions alike."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from X import y``: y may be a module of package X, or a name in module X.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    known = {module_name(p) for p in sources()}
    return {module_name(p): _imports(p, known) for p in sources()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or one that imports itself
    (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1 or node in graph[node]:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_of_the_package_has_no_cycle():
    graph = import_graph()
    assert "kvtier.transfer.dma.backend" in graph and "kvtier.transfer.kernel" in graph["kvtier.transfer.dma.backend"]
    assert not cycles(graph), f"imports must go one way; these modules import each other: {cycles(graph)}"


def test_the_transfer_package_imports_one_way_down():
    """interface <- backends <- factory <- engine: a backend never imports the factory or the
    engine, ``auto`` imports no concrete backend (it is given its candidates), and the
    interface imports no backend."""
    graph = import_graph()
    t = "kvtier.transfer."
    backends = [m for m in graph if m.startswith((t + "kernel", t + "dma", t + "auto", t + "direct"))]
    for m in backends:
        assert not graph[m] & {t + "factory", t + "engine"}, (m, graph[m])
    for m in (x for x in graph if x.startswith(t + "auto")):
        assert not {d for d in graph[m] if d.startswith((t + "kernel", t + "dma"))}, (m, graph[m])
    assert not {d for d in graph[t + "base"] if d.startswith(t)}, graph[t + "base"]


def test_no_backend_instance_or_registration_at_module_level():
    """Each TransferEngine (or host pool) builds or receives its backends: no module-level
    backend objects, and no import kept only for what it registers."""
    found = []
    for p in (PACKAGE / "transfer").rglob("*.py"):
        tree = ast.parse(p.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
                f = node.value.func
                called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
                if called.endswith("Backend") or "register" in called:
                    found.append(f"{p.relative_to(ROOT)}:{node.lineno}")
        if "registers" in p.read_text():
            found.append(f"{p.relative_to(ROOT)}: an import for its side effect")
    assert not found, found


DRIVER = textwrap.dedent("""
    import importlib, os, sys, traceback
    for heavy in ("numpy", "torch", "triton"):   # third-party only: kvtier is not imported here
        try:
            importlib.import_module(heavy)
        except ImportError:
            pass
    assert not any(m == "kvtier" or m.startswith("kvtier.") for m in sys.modules)
    failed = []
    for name in sys.argv[1:]:
        pid = os.fork()
        if pid == 0:   # a child of a kvtier-free interpreter: the module is imported first
            try:
                importlib.import_module(name)
                os._exit(0)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
        if os.waitpid(pid, 0)[1]:
            failed.append(name)
    print("FAILED:" + ",".join(failed))
""")


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """Each module of the package, imported first (before any other of kvtier's), in a child
    of an interpreter that has imported only third-party libraries: an order-dependent import
    (a cycle that works only when another module is imported first) fails here."""
    names = sorted(module_name(p) for p in sources())
    try:
        import triton  # noqa: F401
    except ImportError:  # the CUDA backends need Triton; without it only those may fail
        names = [n for n in names if not n.startswith(("kvtier.transfer.kernel", "kvtier.transfer.dma",
                                                       "kvtier.transfer.auto", "kvtier.transfer.triton",
                                                       "kvtier.transfer.cuda_common"))]
    run = subprocess.run([sys.executable, "-c", DRIVER, *names], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = run.stdout.strip().rpartition("FAILED:")[2]
    assert failed == "", f"these modules fail to import alone: {failed}\n{run.stderr[-3000:]}"


def test_import_kvtier_transfer_in_a_fresh_interpreter():
    run = subprocess.run([sys.executable, "-c", "import kvtier.transfer"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr


def _git_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.split()


def test_the_tree_keeps_the_product_not_the_lab():
    files = _git_files()
    outside_tests = [f for f in files if not f.startswith("tests/")]
    results = [f for f in files if f.startswith("bench/results/")]
    assert len(outside_tests) <= 120, f"{len(outside_tests)} tracked files outside tests/"
    assert len(results) <= 20, f"bench/results holds {len(results)} files: keep only those the docs cite"


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "<!-- test-command -->" in readme
    for doc in ("usage", "architecture", "configuration", "performance", "seed-compatibility"):
        assert f"docs/{doc}.md" in readme, doc
        assert (ROOT / "docs" / f"{doc}.md").is_file(), doc
    assert len((ROOT / "docs" / "performance.md").read_text().splitlines()) <= 300


def test_every_file_the_docs_and_the_code_cite_exists():
    """A path into the tree named by the README, the docs or the package's docstrings exists."""
    cited = re.compile(r"\b((?:bench|docs|tests|scripts|kvtier)/[A-Za-z0-9_./-]+\.(?:py|json|log|md|png|sh))\b")
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sources()]
    missing = sorted({f"{t.relative_to(ROOT)}: {m}" for t in texts for m in cited.findall(t.read_text())
                      if "*" not in m and not (ROOT / m).exists()})
    assert not missing, missing
