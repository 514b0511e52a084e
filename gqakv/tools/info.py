"""``gqakv info``: the backend table, with the reason each unavailable backend gives."""

from __future__ import annotations

import json

from ..dispatch.registry import ENTRY_POINT_GROUP, ENV_VAR, describe_backends, get_backend, list_backends


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the table as JSON")


def run(args) -> int:
    rows = describe_backends()
    # Each backend's implementations (fused kernels, ...) and their declared limits.
    impls = {b.name: b.implementations() for b in list_backends()}
    # What each fast path declares it implements (Backend.fast_paths, class data).
    declared_paths = {b.name: {p.name: p.describe() for p in b.fast_paths} for b in list_backends()}
    # Advice on the process's threads that would cost a backend time (Backend.thread_note).
    notes = {b.name: b.thread_note() for b in list_backends()}
    for r in rows:
        r["implementations"] = impls.get(r["name"], {})
        r["fast_paths"] = declared_paths.get(r["name"], {})
        r["thread_note"] = notes.get(r["name"]) if r["available"] else None
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"gqakv backends (entry-point group {ENTRY_POINT_GROUP!r}; highest priority first)")
    for r in rows:
        state = "available" if r["available"] else "unavailable: " + r["reason"]
        print(f"  {r['name']:<18} priority {str(r['priority']):>5}  {r['array_library']}/{r['device']}  {state}")
        if r["available"]:
            dims = r["head_dims"] if r["head_dims"] == "any" else ", ".join(map(str, r["head_dims"]))
            print(f"  {'':<18} dtypes: {', '.join(r['dtypes'])}; head dims: {dims}")
            if r["features"]:
                print(f"  {'':<18} features: {', '.join(r['features'])}")
        for impl, declared in r["implementations"].items():
            print(f"  {'':<18} {impl}: {declared}")
        for impl, declared in r["fast_paths"].items():
            print(f"  {'':<18} declares {impl}: {declared}")
        if r["thread_note"]:
            print(f"  {'':<18} note: {r['thread_note']}")
    try:
        chosen = get_backend(None).name
    except Exception as exc:  # say why nothing could be chosen instead of a traceback
        chosen = f"none ({exc})"
    print(f"auto/default choice here ({ENV_VAR} and use_backend() apply first): {chosen}")
    return 0
