"""Layer 8, the `dpaudit` command line (imported as dpaudit.cli). May import every layer."""
