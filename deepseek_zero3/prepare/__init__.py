"""What prepare_data.py uses to turn text into token files: documents, corpora, the tokenizer processes and the token
writer."""
