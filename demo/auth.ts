/**
 * The demo's signed-in users: two of the shop's customers, each signed in with a token the demo
 * signs itself (an HS256 key made at every start; no external issuer). The token names the role
 * shop_web, which logs in with a password only the proxy holds (a passfile next to the data), and
 * Row-Level Security shows each customer their own row and orders, by edgepg.claims().
 */
import { randomBytes } from 'node:crypto'
import { chmod, writeFile } from 'node:fs/promises'
import { SignJWT } from 'jose'
import pg from 'pg'
import { setupAuth } from '../proxy/auth/setup'
import type { TokenLoginOptions } from '../proxy/auth/token-login'

export const WEB_ROLE = 'shop_web'
const AUDIENCE = 'edgepg-demo'
const ISSUER = 'edgepg demo sign-in'

/** Who may sign in: a customer each (ids as seeded, see seed.ts). */
export const USERS = {
  ada: { name: 'Ada Lovelace', customer: 1 },
  grace: { name: 'Grace Hopper', customer: 2 },
} as const
export type DemoUser = keyof typeof USERS

/**
 * The role, its password (new at every start, written to `passfile` for the proxy alone), setup-auth
 * and the policies, on `database` as `superuser`: idempotent, for a data directory seeded before too.
 */
export async function setupDemoAuth(conn: pg.ClientConfig, passfile: string): Promise<TokenLoginOptions & { sign(user: DemoUser): Promise<string> }> {
  const password = randomBytes(18).toString('base64url')
  const admin = new pg.Client(conn)
  await admin.connect()
  try {
    await admin.query(`DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '${WEB_ROLE}') THEN CREATE ROLE ${WEB_ROLE} LOGIN; END IF; END $$`)
    await admin.query(`ALTER ROLE ${WEB_ROLE} PASSWORD '${password}'`)
    await admin.query(`GRANT SELECT ON customers, orders, order_items, products TO ${WEB_ROLE}`)
    const mine = (table: string, column: string) => `
      ALTER TABLE ${table} ENABLE ROW LEVEL SECURITY;
      DROP POLICY IF EXISTS own_rows ON ${table};
      CREATE POLICY own_rows ON ${table} TO ${WEB_ROLE} USING (${column} = (SELECT (edgepg.claims() ->> 'customer_id')::int));`
    await setupAuth(`postgres://${conn.user}:${encodeURIComponent(String(conn.password))}@${conn.host}:${conn.port}/${conn.database}`)
    await admin.query(mine('customers', 'id') + mine('orders', 'customer_id'))
  } finally {
    await admin.end()
  }
  await writeFile(passfile, `${conn.host}:${conn.port}:${conn.database}:${WEB_ROLE}:${password}\n`, { mode: 0o600 })
  await chmod(passfile, 0o600)
  const secret = randomBytes(32)
  return {
    secret,
    audience: AUDIENCE,
    issuer: ISSUER,
    roles: [WEB_ROLE],
    passfile,
    sign: (user) =>
      new SignJWT({ sub: user, name: USERS[user].name, customer_id: USERS[user].customer, role: WEB_ROLE })
        .setProtectedHeader({ alg: 'HS256' })
        .setIssuedAt()
        .setExpirationTime('1h')
        .setAudience(AUDIENCE)
        .setIssuer(ISSUER)
        .sign(secret),
  }
}
