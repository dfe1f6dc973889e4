"""The ``speccheck`` command line: the typer app (:mod:`.app`), one module per command that
needs more than a few lines, and the runtime-configuration options shared by commands.
Commands validate input and exit with statuses CI can trust; they hold no verification
logic of their own."""
