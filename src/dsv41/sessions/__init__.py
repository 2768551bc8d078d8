"""Sessions: a conversation's next turn resumes from a stored entry instead of prefilling again (docs/SESSIONS.md).

files.py is the NVMe tier's file store (torch-free)."""
