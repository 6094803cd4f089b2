"""Help texts that more than one command shows (``hsstream submit`` and ``hsstream train --submit``
take the same submission options): written once so the two cannot drift apart."""

H_ON_INVALID = "skip (default) | reject: a row no trainer can use is skipped and counted per reason, or refuses the job"
H_MAX_TOKENS = "cap on a sample's tokens (see --overlong)"
H_OVERLONG = "truncate | reject (default): what a sample over the cap becomes"
H_KWARGS = 'the chat template\'s variables as JSON, as vLLM\'s chat_template_kwargs, e.g. \'{"enable_thinking": false}\''
H_MODE = "extract (default: train on the data's replies) | regenerate (vLLM writes new replies: speculators' and EAGLE-3's recipe)"
H_TEMPERATURE = "--mode regenerate: sampling temperature of the new replies (default 0)"
H_TOP_P = "--mode regenerate: top-p of the new replies (default 1)"
H_MAX_NEW = "--mode regenerate: tokens a new reply may have (default 256)"
H_SAMPLING_SEED = "--mode regenerate: seed of the replies (each epoch gets its own, derived from it)"
