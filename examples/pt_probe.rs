use std::time::Instant;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer};
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let tok = Tokenizer::from_file(&args[1]).unwrap();
    let text = std::fs::read_to_string(&args[2]).unwrap();
    let n: usize = args[3].parse().unwrap();
    let text: String = text.chars().take(n).collect();
    for _ in 0..2 {
        let t = Instant::now();
        let enc = tok.encode_fast(text.as_str(), false).unwrap();
        let full = t.elapsed();
        let pt = tok.get_pre_tokenizer().unwrap();
        let t = Instant::now();
        let mut s = PreTokenizedString::from(text.as_str());
        pt.pre_tokenize(&mut s).unwrap();
        let splits = s.get_splits(OffsetReferential::Original, OffsetType::None);
        let pre = t.elapsed();
        println!(
            "chars {} ids {} full {:?} pretok {:?} splits {}",
            n,
            enc.get_ids().len(),
            full,
            pre,
            splits.len()
        );
    }
}
