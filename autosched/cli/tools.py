"""``autosched report``, ``rpc-server`` and ``db``."""

from __future__ import annotations


def cmd_report(args) -> int:
    from ..output import check_output_folder
    from ..report import write_report

    check_output_folder(args.output, "the report")
    print(write_report(args.db, args.output, args.bench))
    return 0


def cmd_rpc_server(args) -> int:
    from ..measure.rpc import serve

    serve(args.tracker, args.key, args.host, args.port, args.port_end, args.custom_addr)
    return 0


def cmd_db(args) -> int:
    from ..database import cli as db_cli

    return db_cli.run(args)
