"""File formats and file-system safety under everything else: atomic durable writes
(atomic.py) and Hugging Face weight files (hf_files.py)."""
