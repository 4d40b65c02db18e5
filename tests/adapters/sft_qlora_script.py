"""sft_lora_script.py with QLoRA's base: the model loaded in 4 bits (bitsandbytes NF4, fp32 compute). TRL's
``SFTTrainer`` sees a 4-bit model and prepares it as one (it casts the LoRA adapters to bf16). Nothing in it knows
about zinf.

    python sft_qlora_script.py MODEL_DIR OUTPUT_DIR RESULT_JSON
"""

import torch
from transformers import BitsAndBytesConfig

from sft_lora_script import main

if __name__ == "__main__":
    main(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                bnb_4bit_compute_dtype=torch.float32))
