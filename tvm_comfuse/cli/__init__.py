"""The ``comfuse`` command: a thin layer over the library (one module per subcommand)."""

import argparse


def subcommand(sub, name: str, help_: str, doc: str, examples: str, run) -> argparse.ArgumentParser:
    """A subcommand parser whose ``--help`` shows the module's doc and worked examples."""
    parser = sub.add_parser(
        name, help=help_, description=doc, epilog=examples, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.set_defaults(func=run)
    return parser
