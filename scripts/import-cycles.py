#!/usr/bin/env python3
"""Import cycles between the orchestrator's source files.

Reads orchestrator/src/**/*.rs (test files and `#[cfg(test)]` modules left out), builds the
graph file -> file from the `crate::...` paths each file names (in `use crate::...` items,
brace groups expanded, and in paths written in code), each path resolved to the file of its
longest prefix that is a module, and prints the strongly connected components of more than
one file (size and members) and how many files are in a cycle. Comments (doc links
included) are not imports and are left out.

Usage: scripts/import-cycles.py [SRC_DIR]   (default: orchestrator/src of this checkout)

Another revision, without touching the checkout:
    git archive REV orchestrator/src | tar -x -C DIR && scripts/import-cycles.py DIR/orchestrator/src
"""

import os
import re
import sys

RAW_STRING = re.compile(r'b?r(#*)"')
TEST_FILE = re.compile(r"(^|_)tests?\.rs$|^test_utils\.rs$")


def module_of(src, path):
    """The module path (a tuple) of a source file."""
    rel = os.path.relpath(path, src)[: -len(".rs")].split(os.sep)
    if rel == ["lib"]:
        return ()
    if rel[-1] == "mod":
        rel = rel[:-1]
    return tuple(rel)


def strip_comments(text):
    """The text without // and /* */ comments (string literals kept as they are)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif c == "'" and text.startswith(("'\"'", "'\\\"'"), i):
            # A char literal of a double quote: not the start of a string.
            j = text.find("'", i + 1)
            out.append(text[i : j + 1])
            i = j + 1
        elif (m := RAW_STRING.match(text, i)) and (i == 0 or not text[i - 1].isalnum()):
            end = '"' + m.group(1)
            j = text.find(end, m.end())
            j = n if j < 0 else j + len(end)
            out.append(text[i:j])
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def strip_test_modules(text):
    """The text without `#[cfg(test)] mod name { ... }` blocks."""
    pattern = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")
    while True:
        m = pattern.search(text)
        if not m:
            return text
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        text = text[: m.start()] + text[j:]


def test_only_modules(text):
    """Names of the child modules declared `#[cfg(test)] mod name;`."""
    return set(re.findall(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text))


def expand_use(tree):
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e] (as lists of segments)."""
    tree = tree.strip()
    depth = 0
    for i, c in enumerate(tree):
        if c == "{":
            if depth == 0:
                prefix = [s for s in tree[:i].strip().rstrip(":").split("::") if s]
                inner = tree[i + 1 : tree.rfind("}")]
                parts, level, start = [], 0, 0
                for k, ch in enumerate(inner):
                    if ch == "{":
                        level += 1
                    elif ch == "}":
                        level -= 1
                    elif ch == "," and level == 0:
                        parts.append(inner[start:k])
                        start = k + 1
                parts.append(inner[start:])
                out = []
                for p in parts:
                    if p.strip():
                        out += [prefix + sub for sub in expand_use(p)]
                return out
            depth += 1
    path = re.split(r"\s+as\s+", tree)[0]
    return [[s for s in path.split("::") if s]]


def crate_paths(text):
    """Every `crate::...` path the text names, as lists of segments (after `crate`)."""
    paths = []
    for m in re.finditer(r"\buse\s+crate::([^;]*);", text, re.S):
        paths += expand_use(m.group(1))
    rest = re.sub(r"\buse\s+crate::[^;]*;", "", text, flags=re.S)
    for m in re.finditer(r"\bcrate((?:::\w+)+)", rest):
        paths.append(m.group(1).strip(":").split("::"))
    return paths


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "orchestrator", "src")
    files = {}
    texts = {}
    test_modules = set()
    for dirpath, dirs, names in os.walk(src):
        dirs[:] = [d for d in dirs if d != "tests"]
        for name in names:
            if not name.endswith(".rs") or TEST_FILE.search(name):
                continue
            path = os.path.join(dirpath, name)
            module = module_of(src, path)
            if module and module[0] == "bin":
                continue
            with open(path, encoding="utf-8") as f:
                text = strip_comments(f.read())
            for child in test_only_modules(text):
                test_modules.add(module + (child,))
            files[module] = os.path.relpath(path, src)
            texts[module] = strip_test_modules(text)
    # A module declared test-only, and everything under it, is left out.
    for module in list(files):
        if any(module[: len(t)] == t for t in test_modules):
            del files[module]
            del texts[module]

    graph = {m: set() for m in files}
    for module, text in texts.items():
        for path in crate_paths(text):
            for k in range(len(path), -1, -1):
                target = tuple(path[:k])
                if target in files:
                    if target != module:
                        graph[module].add(target)
                    break

    # Tarjan's strongly connected components (iterative).
    index, low, on_stack, stack, sccs, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    sccs.append(sorted(files[m] for m in component))

    sccs.sort(key=lambda c: (-len(c), c))
    for component in sccs:
        print(f"cycle of {len(component)} files:")
        for f in component:
            print(f"  {f}")
    print(f"files: {len(files)}; cycles: {len(sccs)}; files in cycles: {sum(map(len, sccs))}")


if __name__ == "__main__":
    main()
