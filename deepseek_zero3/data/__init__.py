"""Data in: what prepare_data.py reads (documents, corpora), the tokenizer processes and the token writer."""
