/**
 * The demo's sample data: a tiny shop. Deterministic (no random()), so the same rows come back
 * on every machine and tests can name them. Sent as one simple query, which Postgres runs as one
 * transaction: a seed is either all there or not at all.
 */

/** The login the SQL console uses; it owns the `shop` database. */
export const DEMO_ROLE = { user: 'demo', password: 'demo', database: 'shop' } as const

export const CUSTOMERS = [
  ['Ada Lovelace', 'London'],
  ['Grace Hopper', 'New York'],
  ['Alan Turing', 'Manchester'],
  ['Edsger Dijkstra', 'Eindhoven'],
  ['Barbara Liskov', 'Boston'],
  ['Donald Knuth', 'Stanford'],
  ['Margaret Hamilton', 'Cambridge'],
  ['Ken Thompson', 'Berkeley'],
  ['Frances Allen', 'Peru, NY'],
  ['John McCarthy', 'Boston'],
  ['Radia Perlman', 'Portsmouth'],
  ['Tony Hoare', 'Oxford'],
] as const

const PRODUCTS = [
  ['Espresso beans, 1 kg', 'coffee', '24.50', 40],
  ['Filter roast, 500 g', 'coffee', '12.90', 55],
  ['Decaf, 250 g', 'coffee', '8.40', 18],
  ['Green tea, 100 g', 'tea', '9.90', 30],
  ['Earl Grey, 100 g', 'tea', '7.50', 26],
  ['Pour-over dripper', 'gear', '29.00', 12],
  ['Hand grinder', 'gear', '89.00', 7],
  ['Gooseneck kettle', 'gear', '64.00', 9],
  ['Paper filters ×100', 'gear', '5.20', 120],
  ['Stoneware mug', 'gear', '16.00', 34],
] as const

const lit = (s: string) => `'${s.replace(/'/g, "''")}'`

export const SEED_SQL = `
CREATE TABLE customers (
  id serial PRIMARY KEY,
  name text NOT NULL,
  email text NOT NULL UNIQUE,
  city text NOT NULL,
  joined_at date NOT NULL
);
CREATE TABLE products (
  id serial PRIMARY KEY,
  name text NOT NULL,
  category text NOT NULL,
  price numeric(8,2) NOT NULL,
  stock int NOT NULL
);
CREATE TABLE orders (
  id serial PRIMARY KEY,
  customer_id int NOT NULL REFERENCES customers,
  ordered_at timestamptz NOT NULL,
  status text NOT NULL
);
CREATE TABLE order_items (
  order_id int NOT NULL REFERENCES orders,
  product_id int NOT NULL REFERENCES products,
  quantity int NOT NULL,
  PRIMARY KEY (order_id, product_id)
);
INSERT INTO customers (name, email, city, joined_at) VALUES
${CUSTOMERS.map(([name, city], i) => `  (${lit(name)}, ${lit(`${name.split(' ')[0].toLowerCase()}@example.com`)}, ${lit(city)}, date '2024-01-15' + ${i * 23})`).join(',\n')};
INSERT INTO products (name, category, price, stock) VALUES
${PRODUCTS.map(([name, category, price, stock]) => `  (${lit(name)}, ${lit(category)}, ${price}, ${stock})`).join(',\n')};
INSERT INTO orders (customer_id, ordered_at, status)
  SELECT 1 + (i * 7) % ${CUSTOMERS.length}, timestamptz '2025-03-03 09:00+00' + i * interval '1 day 5 hours',
         (ARRAY['delivered', 'delivered', 'shipped', 'paid'])[1 + i % 4]
  FROM generate_series(0, 29) AS i;
INSERT INTO order_items (order_id, product_id, quantity)
  SELECT o.id, 1 + (o.id * 3 + k * 3) % ${PRODUCTS.length}, 1 + (o.id + k) % 3
  FROM orders AS o, generate_series(0, 2) AS k
  WHERE k <= o.id % 3;
`
