"""Process-wide settings every entry point shares: seeding, torch's thread count, lazy exports."""
