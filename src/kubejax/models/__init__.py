"""Model families behind one interface (`kubejax.models.families`): the BERT encoder and the
decoder LLMs (Llama, Mistral, Qwen2, Qwen3, Gemma 3), in Flax NNX, loaded from and exported to
Hugging Face checkpoints (`kubejax.models.weights`)."""
