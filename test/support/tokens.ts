/**
 * What the token tests share: two login roles tokens may name, their passwords in a passfile, a
 * table whose rows each belong to a `sub` (RLS by edgepg.claims()), `setup-auth` run on the test
 * database, and tokens signed with an HS256 secret.
 */
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import pg from 'pg'
import { SignJWT, type JWTPayload } from 'jose'
import { setupAuth } from '../../proxy/auth/setup'
import type { TokenLoginOptions } from '../../proxy/auth/token-login'
import { PASSWORD, testPostgres, type PgInfo } from './stack'

export const WEB_USER = 'edgepg_web_user'
export const WEB_ADMIN = 'edgepg_web_admin'
export const AUDIENCE = 'edgepg-tests'
export const ISSUER = 'https://issuer.test/'
export const SECRET = new TextEncoder().encode('a secret of the tests, at least 32 bytes long')
const ROLE_PASSWORD = 'web-role-pw'

/** The test database as its superuser sees it. */
export const superuserUrl = (db = testPostgres()) => `postgres://postgres:${encodeURIComponent(PASSWORD)}@${db.host}:${db.port}/${db.database}`

/** A token for `sub` as `role` (default WEB_USER), valid for `seconds`; `extra` claims, or `header` changes, on top. */
export function token(sub: string, o: { role?: string | null; seconds?: number; extra?: JWTPayload; secret?: Uint8Array; audience?: string; issuer?: string; nbf?: number } = {}) {
  const now = Math.floor(Date.now() / 1000)
  const claims: JWTPayload = { sub, ...(o.role !== null && { role: o.role ?? WEB_USER }), ...o.extra }
  const jwt = new SignJWT(claims)
    .setProtectedHeader({ alg: 'HS256' })
    .setIssuedAt(now)
    .setExpirationTime(now + (o.seconds ?? 300))
    .setAudience(o.audience ?? AUDIENCE)
    .setIssuer(o.issuer ?? ISSUER)
  if (o.nbf !== undefined) jwt.setNotBefore(o.nbf)
  return jwt.sign(o.secret ?? SECRET)
}

/** The roles, the passfile, the table and setup-auth; `teardown` removes them. */
export async function tokenFixture(table: string, db: PgInfo = testPostgres()) {
  const admin = new pg.Client({ connectionString: superuserUrl(db), application_name: 'edgepg-token-fixture' })
  await admin.connect()
  await admin.query(`SET password_encryption = 'scram-sha-256'`)
  // Test files run at once: one at a time makes the roles and runs setup-auth.
  await admin.query('SELECT pg_advisory_lock(4646)')
  try {
    for (const role of [WEB_USER, WEB_ADMIN]) {
      await admin.query(`DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '${role}') THEN CREATE ROLE ${role} LOGIN NOSUPERUSER; END IF; END $$`)
      await admin.query(`ALTER ROLE ${role} PASSWORD '${ROLE_PASSWORD}'`)
    }
    await setupAuth(superuserUrl(db))
  } finally {
    await admin.query('SELECT pg_advisory_unlock(4646)')
  }
  await admin.query(`CREATE TABLE ${table} (id serial PRIMARY KEY, owner text NOT NULL DEFAULT edgepg.claims() ->> 'sub', body text)`)
  await admin.query(`ALTER TABLE ${table} ENABLE ROW LEVEL SECURITY`)
  await admin.query(`CREATE POLICY own ON ${table} USING (owner = edgepg.claims() ->> 'sub') WITH CHECK (owner = edgepg.claims() ->> 'sub')`)
  await admin.query(`GRANT SELECT, INSERT, UPDATE, DELETE ON ${table} TO ${WEB_USER}, ${WEB_ADMIN}`)
  await admin.query(`GRANT USAGE ON SEQUENCE ${table}_id_seq TO ${WEB_USER}, ${WEB_ADMIN}`)
  await admin.query(`INSERT INTO ${table} (owner, body) VALUES ('alice', 'alice''s note'), ('bob', 'bob''s note')`)
  // --listen-policy: each user may hear "user:<their sub>" (docs/realtime.md).
  const listenPolicy = `public.${table}_may_listen`
  await admin.query(`CREATE FUNCTION ${listenPolicy}(channel text) RETURNS boolean LANGUAGE sql STABLE AS $$ SELECT channel = 'user:' || (edgepg.claims() ->> 'sub') $$`)
  const dir = await mkdtemp(join(tmpdir(), 'edgepg-passfile-'))
  const passfile = join(dir, 'pgpass')
  await writeFile(passfile, `${db.host}:${db.port}:*:${WEB_USER}:${ROLE_PASSWORD}\n${db.host}:${db.port}:*:${WEB_ADMIN}:${ROLE_PASSWORD}\n`)
  await chmod(passfile, 0o600)
  const options: TokenLoginOptions = { secret: SECRET, audience: AUDIENCE, issuer: ISSUER, roles: [WEB_USER, WEB_ADMIN], passfile }
  return {
    admin,
    passfile,
    options,
    listenPolicy,
    async teardown() {
      await admin.query(`DROP TABLE IF EXISTS ${table}`).catch(() => {})
      await admin.query(`DROP FUNCTION IF EXISTS ${listenPolicy}`).catch(() => {})
      await admin.query(`ALTER ROLE ${WEB_USER} RESET ALL`).catch(() => {})
      await admin.end()
      await rm(dir, { recursive: true, force: true })
    },
  }
}

/**
 * What a holder of a valid token for alice may try, in her own session, to be someone else or to
 * read someone else's claims (`table`: the one RLS guards). Each is run (its error, if any, ignored);
 * after each, edgepg.claims() must still say alice and RLS show only her rows.
 */
export const claimsAttacks = (table: string): string[] => [
  `SET edgepg.claims = '{"sub":"bob"}'`,
  `SELECT set_config('edgepg.claims', '{"sub":"bob"}', false)`,
  `SELECT set_config('request.jwt.claims', '{"sub":"bob"}', false)`,
  `BEGIN; SET LOCAL edgepg.claims = '{"sub":"bob"}'; SELECT 1`,
  `ROLLBACK`,
  `RESET ROLE`,
  `SET ROLE ${WEB_ADMIN}`,
  `SET ROLE postgres`,
  `SET SESSION AUTHORIZATION postgres`,
  `RESET SESSION AUTHORIZATION`,
  `RESET ALL`,
  `DISCARD ALL`,
  `DISCARD SEQUENCES`,
  `SELECT edgepg.init(decode(repeat('00', 32), 'hex'))`,
  `SELECT edgepg.init(decode(repeat('ab', 64), 'hex'))`,
  ...[1, 2, 3, 4, 100].map((n) => `SELECT edgepg.set_claims(${n}, '{"sub":"bob"}', decode(repeat('00', 32), 'hex'))`),
  `SELECT edgepg.set_claims(NULL, '{"sub":"bob"}', NULL)`,
  `SELECT edgepg.started()`,
  `SELECT * FROM edgepg.backends`,
  `UPDATE edgepg.backends SET claims = '{"sub":"bob"}'`,
  `INSERT INTO edgepg.backends (pid, started, key) VALUES (pg_backend_pid(), now(), '\\x00')`,
  `DELETE FROM edgepg.backends`,
  `CREATE TEMP TABLE backends (pid int, started timestamptz, key bytea, n bigint, claims jsonb)`,
  `INSERT INTO pg_temp.backends VALUES (pg_backend_pid(), now(), '\\x00', 0, '{"sub":"bob"}')`,
  `SET search_path = pg_temp, edgepg, public`,
  `CREATE FUNCTION pg_temp.claims() RETURNS jsonb LANGUAGE sql AS $$ SELECT '{"sub":"bob"}'::jsonb $$`,
  `CREATE FUNCTION pg_temp.started() RETURNS timestamptz LANGUAGE sql AS $$ SELECT now() $$`,
  `CREATE FUNCTION public.hmac(bytea, bytea, text) RETURNS bytea LANGUAGE sql AS $$ SELECT '\\x00'::bytea $$`,
  `CREATE SCHEMA edgepg_fake`,
  `DROP FUNCTION edgepg.claims()`,
  `CREATE OR REPLACE FUNCTION edgepg.claims() RETURNS jsonb LANGUAGE sql AS $$ SELECT '{"sub":"bob"}'::jsonb $$`,
  `ALTER TABLE edgepg.backends DISABLE ROW LEVEL SECURITY`,
  `ALTER TABLE ${table} DISABLE ROW LEVEL SECURITY`,
  `LOCK TABLE edgepg.backends`,
]
