"""A held-out set of small real tasks of the kinds users bring, written by hand.

Eight tasks (capitals, a city's country, antonyms, past tenses, numbers in words, review sentiment,
the name in a sentence, moving a sentence's last word to the front) of 32 (input, output) pairs each,
every answer a single unambiguous one. They measure how well a task registered from a few examples
does against the same examples given in context: :func:`real_task_examples` draws the ``k`` training
examples from a task's first 16 pairs and always tests on its last 16.

The set is held out of every inventory's training: no procedural suite task, no BIG-bench training
task and no generated training example is one of these (pinned by tests/training/test_real_tasks.py).

>>> train, test = real_task_examples("capital", 4, seed=0)
>>> len(train), len(test), test[0].task
(4, 16, 'real-capital')
"""

from __future__ import annotations

import random

from training.data import Example

__all__ = ["N_TEST", "PAIRS", "REAL_TASKS", "real_task_examples"]

#: Pairs per task; the last N_TEST of them are the fixed test examples, the rest the training pool.
N_PAIRS = 32
N_TEST = 16

REAL_TASKS: dict[str, str] = {
    "capital": "a country -> its capital city",
    "city-country": "a well-known city that is not a capital -> the country it is in",
    "antonym": "an adjective -> its common antonym",
    "past-tense": "a verb -> its simple past tense",
    "number-word": "a number from 1 to 99 in digits -> the number in lowercase English words",
    "sentiment": "a short movie or product review -> positive or negative",
    "name-in-sentence": "a sentence mentioning one person by first name -> that name",
    "last-word-first": "a short sentence -> the same words with the last one moved to the front",
}

PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "capital": (
        ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"),
        ("Spain", "Madrid"), ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Egypt", "Cairo"),
        ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"), ("Greece", "Athens"),
        ("Thailand", "Bangkok"), ("Argentina", "Buenos Aires"), ("Portugal", "Lisbon"), ("Poland", "Warsaw"),
        # test
        ("Sweden", "Stockholm"), ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Hungary", "Budapest"),
        ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Turkey", "Ankara"), ("Cuba", "Havana"),
        ("Vietnam", "Hanoi"), ("South Korea", "Seoul"), ("Iran", "Tehran"), ("Nigeria", "Abuja"),
        ("Ghana", "Accra"), ("Ethiopia", "Addis Ababa"), ("Belgium", "Brussels"), ("Pakistan", "Islamabad"),
    ),
    "city-country": (
        ("Barcelona", "Spain"), ("Milan", "Italy"), ("Munich", "Germany"), ("Osaka", "Japan"),
        ("Sydney", "Australia"), ("Toronto", "Canada"), ("Marseille", "France"), ("Rio de Janeiro", "Brazil"),
        ("Shanghai", "China"), ("Mumbai", "India"), ("Istanbul", "Turkey"), ("Casablanca", "Morocco"),
        ("Porto", "Portugal"), ("Geneva", "Switzerland"), ("Alexandria", "Egypt"),
        ("Auckland", "New Zealand"),
        # test
        ("Seville", "Spain"), ("Naples", "Italy"), ("Hamburg", "Germany"), ("Kyoto", "Japan"),
        ("Melbourne", "Australia"), ("Vancouver", "Canada"), ("Lyon", "France"), ("Rotterdam", "Netherlands"),
        ("Antwerp", "Belgium"), ("Gothenburg", "Sweden"), ("Zurich", "Switzerland"), ("Bangalore", "India"),
        ("Johannesburg", "South Africa"), ("Guangzhou", "China"), ("Busan", "South Korea"),
        ("Dubai", "United Arab Emirates"),
    ),
    "antonym": (
        ("hot", "cold"), ("fast", "slow"), ("happy", "sad"), ("full", "empty"),
        ("wet", "dry"), ("open", "closed"), ("rich", "poor"), ("strong", "weak"),
        ("thick", "thin"), ("early", "late"), ("loud", "quiet"), ("clean", "dirty"),
        ("cheap", "expensive"), ("alive", "dead"), ("deep", "shallow"), ("true", "false"),
        # test
        ("wide", "narrow"), ("long", "short"), ("urban", "rural"), ("awake", "asleep"),
        ("beautiful", "ugly"), ("smooth", "rough"), ("heavy", "light"), ("guilty", "innocent"),
        ("present", "absent"), ("visible", "invisible"), ("possible", "impossible"), ("private", "public"),
        ("inner", "outer"), ("major", "minor"), ("tight", "loose"), ("permanent", "temporary"),
    ),
    "past-tense": (
        ("go", "went"), ("eat", "ate"), ("run", "ran"), ("see", "saw"),
        ("write", "wrote"), ("take", "took"), ("walk", "walked"), ("play", "played"),
        ("jump", "jumped"), ("swim", "swam"), ("buy", "bought"), ("think", "thought"),
        ("cook", "cooked"), ("open", "opened"), ("sing", "sang"), ("carry", "carried"),
        # test
        ("drink", "drank"), ("bring", "brought"), ("catch", "caught"), ("teach", "taught"),
        ("fly", "flew"), ("speak", "spoke"), ("break", "broke"), ("choose", "chose"),
        ("forget", "forgot"), ("begin", "began"), ("watch", "watched"), ("cry", "cried"),
        ("stop", "stopped"), ("plan", "planned"), ("dance", "danced"), ("listen", "listened"),
    ),
    "number-word": (
        ("1", "one"), ("13", "thirteen"), ("21", "twenty-one"), ("7", "seven"),
        ("40", "forty"), ("58", "fifty-eight"), ("11", "eleven"), ("99", "ninety-nine"),
        ("3", "three"), ("66", "sixty-six"), ("15", "fifteen"), ("80", "eighty"),
        ("34", "thirty-four"), ("12", "twelve"), ("89", "eighty-nine"), ("20", "twenty"),
        # test
        ("42", "forty-two"), ("5", "five"), ("18", "eighteen"), ("63", "sixty-three"),
        ("30", "thirty"), ("9", "nine"), ("76", "seventy-six"), ("14", "fourteen"),
        ("92", "ninety-two"), ("2", "two"), ("47", "forty-seven"), ("50", "fifty"),
        ("19", "nineteen"), ("88", "eighty-eight"), ("71", "seventy-one"), ("25", "twenty-five"),
    ),
    "sentiment": (
        ("The acting was superb and the ending made me cry.", "positive"),
        ("The battery died after two days, what a waste.", "negative"),
        ("Not bad at all, I would happily watch it again.", "positive"),
        ("The plot was dull and the jokes fell flat.", "negative"),
        ("This blender is powerful, quiet, and easy to clean.", "positive"),
        ("I would not recommend this phone to anyone.", "negative"),
        ("A charming little film with a lot of heart.", "positive"),
        ("The shoes fell apart within a week of wearing them.", "negative"),
        ("Honestly, the best pair of headphones I have ever owned.", "positive"),
        ("Two hours of my life I will never get back.", "negative"),
        ("The soundtrack is gorgeous and the story never drags.", "positive"),
        ("Cheap plastic, a flimsy lid, and it leaks everywhere.", "negative"),
        ("I was not disappointed, it exceeded every expectation.", "positive"),
        ("The characters were flat and the dialogue felt forced.", "negative"),
        ("Great value for the price, it works perfectly.", "positive"),
        ("Not worth the money, it stopped working immediately.", "negative"),
        # test
        ("Funny, warm, and clever from start to finish.", "positive"),
        ("The camera takes blurry photos even in bright daylight.", "negative"),
        ("This vacuum cleaner saves me so much time every week.", "positive"),
        ("I fell asleep halfway through, it was that boring.", "negative"),
        ("I can't complain, the delivery was fast and the fit is perfect.", "positive"),
        ("The sequel is a lazy copy of the original film.", "negative"),
        ("Every scene is beautifully shot and the cast is wonderful.", "positive"),
        ("The instructions were useless and assembly took forever.", "negative"),
        ("My kids love this game and so do I.", "positive"),
        ("Not funny, not scary, just a mess from beginning to end.", "negative"),
        ("Comfortable, sturdy, and it looks even better than the pictures.", "positive"),
        ("The coffee maker broke the first time I used it.", "negative"),
        ("It never fails to make me smile, a true classic.", "positive"),
        ("Sadly, the charger overheats and the screen flickers constantly.", "negative"),
        ("Surprisingly good, I didn't expect to enjoy it this much.", "positive"),
        ("The acting was wooden and the story made no sense.", "negative"),
    ),
    "name-in-sentence": (
        ("Yesterday Priya fixed the old bike.", "Priya"),
        ("Kenji always takes the early train to work.", "Kenji"),
        ("The letter was finally delivered to Amara this morning.", "Amara"),
        ("After lunch the children followed Mateo into the garden.", "Mateo"),
        ("Fatima baked bread for the whole street.", "Fatima"),
        ("Nobody expected Olga to win the chess game.", "Olga"),
        ("The teacher asked Tariq to read the poem aloud.", "Tariq"),
        ("Every summer Siobhan swims in the cold lake.", "Siobhan"),
        ("Wei painted the fence a bright shade of green.", "Wei"),
        ("The dog barked until Ingrid opened the door.", "Ingrid"),
        ("Kwame plays the drums in a small band.", "Kwame"),
        ("On rainy days the cat sleeps beside Lucia.", "Lucia"),
        ("Her neighbour lent Arjun a ladder and some rope.", "Arjun"),
        ("Yuki forgot her umbrella at the station again.", "Yuki"),
        ("The best soup in town is made by Dmitri.", "Dmitri"),
        ("Last night Zainab finished reading a very long novel.", "Zainab"),
        # test
        ("Thabo repaired the roof before the storm arrived.", "Thabo"),
        ("The old map was found by Aiko in the attic.", "Aiko"),
        ("Every morning Sven walks his dog along the river.", "Sven"),
        ("The committee finally gave the prize to Nadia.", "Nadia"),
        ("Carlos cooked dinner for twelve hungry guests.", "Carlos"),
        ("A stranger handed Mei a small wooden box.", "Mei"),
        ("Without a word Emeka left the crowded room.", "Emeka"),
        ("The baby smiled when Freya started to sing.", "Freya"),
        ("Hamid drew a picture of the mountains at sunset.", "Hamid"),
        ("The tired runners cheered loudly for Ananya.", "Ananya"),
        ("Somehow Pablo managed to fix the broken clock.", "Pablo"),
        ("Two large parcels arrived for Astrid today.", "Astrid"),
        ("Minh grows tomatoes and peppers on the balcony.", "Minh"),
        ("The coach says Oluwaseun is the fastest player on the team.", "Oluwaseun"),
        ("In the evening Leila writes letters to old friends.", "Leila"),
        ("The mechanic told Rafael the car needs new brakes.", "Rafael"),
    ),
    "last-word-first": (
        ("Maria drove to Lisbon", "Lisbon Maria drove to"),
        ("the cat sat on the mat", "mat the cat sat on the"),
        ("we watched a film last night", "night we watched a film last"),
        ("birds sing early in spring", "spring birds sing early in"),
        ("my brother plays the guitar", "guitar my brother plays the"),
        ("rain fell all afternoon", "afternoon rain fell all"),
        ("she bought fresh bread today", "today she bought fresh bread"),
        ("the train leaves at noon", "noon the train leaves at"),
        ("Tom likes green apples", "apples Tom likes green"),
        ("children played in the park", "park children played in the"),
        ("our team won the final match", "match our team won the final"),
        ("he reads books every evening", "evening he reads books every"),
        ("the river flows toward the sea", "sea the river flows toward the"),
        ("Anna painted the kitchen blue", "blue Anna painted the kitchen"),
        ("the old clock stopped working", "working the old clock stopped"),
        ("they walked home after dinner", "dinner they walked home after"),
        # test
        ("the shop opens at nine", "nine the shop opens at"),
        ("Pedro sent a long letter", "letter Pedro sent a long"),
        ("snow covered the quiet village", "village snow covered the quiet"),
        ("my sister speaks three languages", "languages my sister speaks three"),
        ("the baby laughed at the dog", "dog the baby laughed at the"),
        ("we planted roses near the gate", "gate we planted roses near the"),
        ("the bus was late again", "again the bus was late"),
        ("Lena found her keys", "keys Lena found her"),
        ("dogs love long walks outside", "outside dogs love long walks"),
        ("the soup needs more salt", "salt the soup needs more"),
        ("he fixed the broken chair yesterday", "yesterday he fixed the broken chair"),
        ("the moon rose over the hills", "hills the moon rose over the"),
        ("Omar teaches maths at school", "school Omar teaches maths at"),
        ("they sold their old car", "car they sold their old"),
        ("the kettle is boiling now", "now the kettle is boiling"),
        ("a storm is coming tonight", "tonight a storm is coming"),
    ),
}


def real_task_examples(task: str, k: int, seed: int) -> tuple[list[Example], list[Example]]:
    """``k`` training examples of ``task`` drawn with ``seed`` from its first 16 pairs, and its 16 test
    examples: always the last 16 pairs, in order, whatever the seed. ``ValueError`` for an unknown task
    or ``k`` outside 0..16."""
    if task not in PAIRS:
        raise ValueError(f"unknown real task {task!r}; known: {sorted(PAIRS)}")
    pool, test = PAIRS[task][:-N_TEST], PAIRS[task][-N_TEST:]
    if not 0 <= k <= len(pool):
        raise ValueError(f"k must be between 0 and {len(pool)}, got {k}")
    name = f"real-{task}"
    train = random.Random(seed).sample(pool, k)
    return [Example(name, x, y) for x, y in train], [Example(name, x, y) for x, y in test]
