"""qconsole: the typer CLI and the Textual incident console over worker_core. No SQL lives here."""
