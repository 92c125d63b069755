"""The `dpaudit` command line (imported as dpaudit.cli)."""
