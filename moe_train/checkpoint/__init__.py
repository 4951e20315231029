"""Weights on disk: native DCP checkpoints (`dcp`), their safe unpickling (`safe_unpickle`), and
Hugging Face folders: reading and writing through DCP (`hf_checkpoint`), export of a checkpoint
(`hf_export`), the tokenizer files (`hf_tokenizer`) and the command line
(`python -m moe_train.checkpoint.hf import|export`). The name mapping is the model's
(`model.hf_layout`).
"""
