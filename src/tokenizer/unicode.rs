//! Character classes the tokenizers need, defined by Unicode General_Category (UAX #44):
//! `\p{L}`, `\p{N}` and `\p{P}` for pre-tokenizer rules, `Mn` for accent stripping, and
//! `C*` for BERT text cleaning. Categories come from the `unicode-general-category` tables;
//! ASCII takes a fast path.

use unicode_general_category::{GeneralCategory as G, get_general_category};

/// `\p{L}`: Lu, Ll, Lt, Lm, Lo.
pub fn is_letter(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_alphabetic();
    }
    matches!(
        get_general_category(c),
        G::UppercaseLetter
            | G::LowercaseLetter
            | G::TitlecaseLetter
            | G::ModifierLetter
            | G::OtherLetter
    )
}

/// `\p{N}`: Nd, Nl, No (the same set as `char::is_numeric`).
pub fn is_number(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_digit();
    }
    matches!(
        get_general_category(c),
        G::DecimalNumber | G::LetterNumber | G::OtherNumber
    )
}

/// `\p{P}`: Pc, Pd, Ps, Pe, Pi, Pf, Po.
pub fn is_punctuation(c: char) -> bool {
    matches!(
        get_general_category(c),
        G::ConnectorPunctuation
            | G::DashPunctuation
            | G::OpenPunctuation
            | G::ClosePunctuation
            | G::InitialPunctuation
            | G::FinalPunctuation
            | G::OtherPunctuation
    )
}

/// `Mn`: the combining marks that accent stripping removes after NFD.
pub fn is_nonspacing_mark(c: char) -> bool {
    !c.is_ascii() && get_general_category(c) == G::NonspacingMark
}

/// `C*` other than surrogates (which `char` cannot hold): Cc, Cf, Co, Cn.
pub fn is_other(c: char) -> bool {
    matches!(
        get_general_category(c),
        G::Control | G::Format | G::PrivateUse | G::Unassigned | G::Surrogate
    )
}

/// The two-letter category, for tests against an outside table.
pub fn category_abbr(c: char) -> &'static str {
    get_general_category(c).abbreviation()
}
