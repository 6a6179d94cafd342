"""Process plumbing: child spawning, parent-death signals, systemd notification, logging
setup, and the files a user names (read safely)."""
