"""Does the template tournament (`selfopd prompts rank`) predict training?"""
