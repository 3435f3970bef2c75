"""The pre-registered comparison of the cures for the privileged illusion (PREREGISTRATION.md)."""
