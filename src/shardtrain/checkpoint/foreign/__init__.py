"""Other systems' checkpoints behind the reader's interface: DeepSpeed's ZeRO 0-3, AutoTP and AutoEP files
(:mod:`.deepspeed_format`, :mod:`.deepspeed_moe`, :mod:`.deepspeed_reader`, allow-listed unpickling in
:mod:`.deepspeed_pickle`) and torch DCP's (:mod:`.dcp_format`, :mod:`.dcp_reader`: FSDP2, torchtitan). Read, never
trusted, never loaded whole."""
