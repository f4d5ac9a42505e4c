"""`serve launch ...` (also `python -m serve launch ...`).

Under `mpirun -n TP` it is one rank; on its own (a container's PID 1) it starts mpirun with
the engine's TP itself and turns stop signals into a drain (serve/launcher.py).
"""

from __future__ import annotations

import sys

from serve.launch import parse


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: serve launch --engine ENGINE_DIR [options]   (starts mpirun itself)\n"
              "       mpirun -n TP serve launch --engine ENGINE_DIR [options]\n"
              "       serve rank-host [--drain-timeout S] -- CMD...   (a worker host's PID 1)\n"
              "       serve manifests --engine DIR --engine-ref REF --image IMG   (Kubernetes)\n"
              "       serve launch --help   (all options)")
        return 0 if args else 2
    if args[0] == "rank-host":
        from serve.rankhost import main as rank_host

        return rank_host(args[1:])
    if args[0] == "manifests":
        from serve.deploy import main as manifests

        return manifests(args[1:])
    if args[0] != "launch":
        print(f"error: unknown command {args[0]!r} — the command is `serve launch`", file=sys.stderr)
        return 2
    try:
        cfg = parse(args[1:])  # validate before MPI starts, so bad flags cost nothing
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from serve.launcher import launch, under_mpirun

    if not under_mpirun():
        return launch(args[1:], cfg)
    from serve.supervisor import supervise

    return supervise(args[1:], cfg.comm_iface)


if __name__ == "__main__":
    sys.exit(main())
