"""Membership-inference auditing: statistics over canary scores (torch-free) and checkpoint scoring."""
