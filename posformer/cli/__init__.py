"""Command-line mains: thin wrappers around the library, one shared error boundary."""
