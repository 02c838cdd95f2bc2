"""Selection: which prompts a step trains on.

``features`` (the score stage: one forward pass over the pool gives each prompt's embedding, GAIN-RL's angle
concentration and its static features), ``selector`` (ScalingRL's pool -> GAIN-RL's window -> DOTS's draw, round by
round), ``rounds`` (a round's start: ScalingRL's pool, GAIN-RL's window, DOTS's reference set and the round's
weights), ``dots`` (DOTS's pool weights from its predictions, and its round's metrics) and ``screen`` (the likelihood
screen: the policy's chance of writing a prompt's worked solution).
"""
