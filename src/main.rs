fn main() {
    println!("metashard");
}
