use metashard::models::llama::{LlamaModel, Session, argmax};
use metashard::models::paths::{ModelPath, resolve};
use metashard::{Device, parse_devices};

fn main() -> metashard::Result<()> {
    let devs = std::env::args().nth(1).unwrap_or("cpu:1x2".into());
    let ModelPath::Gguf(p) = resolve("smollm2")? else {
        panic!()
    };
    let devices = parse_devices(&devs)?;
    let (be, bt) = if devices.len() == 1 {
        (devices[0].init_backend()?, devices[0].buffer_type())
    } else {
        panic!()
    };
    let t0 = std::time::Instant::now();
    let m = LlamaModel::load(&p, bt.as_ref(), &|_, _| {})?;
    eprintln!("loaded in {:?}", t0.elapsed());
    let ids: Vec<u32> = "1,9690,198,2683,359,253,5356,5646,11173,3365,3511,308,34519,28,7018,411,407,19712,8182,2,198,1,4093,198,1780,314,260,3575,282,4649,47,2,198,1,520,9531,198"
        .split(',').map(|s| s.parse().unwrap()).collect();
    let mut s = Session::new(&m, be, bt.as_ref(), 256)?;
    let t0 = std::time::Instant::now();
    let mut logits = s.eval(&ids, false)?;
    eprintln!("prompt in {:?}", t0.elapsed());
    let mut out = Vec::new();
    for _ in 0..8 {
        let t = argmax(&logits);
        out.push(t);
        logits = s.eval(&[t], false)?;
    }
    println!(
        "{out:?} {:?}",
        m.tokenizer
            .decode_bytes(&out)
            .map(|b| String::from_utf8_lossy(&b).to_string())
    );
    Ok(())
}
