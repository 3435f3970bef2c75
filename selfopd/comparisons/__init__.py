"""Several runs under one budget: `selfopd compare`, the SFT teacher (`selfopd sft`), the template tournament."""
