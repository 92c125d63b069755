"""New-token canaries for membership-inference audits (imported as dpaudit.canaries); filled in by the auditing issue."""
