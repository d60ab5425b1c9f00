/**
 * Asking a backend itself what a session left on it, from Postgres's catalogs: the reading that
 * decides, after any transaction that did more than plain reads and writes. Every name is
 * qualified and every operator spelled OPERATOR(pg_catalog.…), and no literal holds a backslash:
 * the session may have changed search_path, made temporary types, or turned standard strings off.
 */
import { randomBytes } from 'node:crypto'
import { serialize } from 'pg-protocol'

/** What a verification found: state by kind (`statements`: protocol-level prepared statements, which the proxy keeps itself). */
export interface Found {
  /** The database runs code of its own on reads and writes (triggers, rules, user functions, state-setting calls in definitions), if it was asked. */
  code?: boolean
  left: string[]
  statements: number
}

const EQ = 'OPERATOR(pg_catalog.=)'

/**
 * The built-ins that set session state, as the node trees of views, defaults, checks, policies and
 * index expressions name them (`:funcid <oid> `, or `:opfuncid` for an operator): asked once per
 * lender, since scanning pg_proc for them costs milliseconds.
 */
export const STATE_FUNCTIONS = serialize.query(`SELECT ':(op)?funcid (' OPERATOR(pg_catalog.||) pg_catalog.string_agg(oid::pg_catalog.text, '|') OPERATOR(pg_catalog.||) ') '
  FROM pg_catalog.pg_proc WHERE pronamespace ${EQ} 11 AND provolatile ${EQ} 'v'
  AND proname OPERATOR(pg_catalog.~) '^(set_config|pg_advisory_|pg_try_advisory_|setseed|pg_notification)'`)

/** Whether the database runs code of its own: see Found.code. `stateFunctions`: STATE_FUNCTIONS's answer. */
function runsCode(stateFunctions: string): string {
  return `EXISTS (SELECT FROM pg_catalog.pg_trigger WHERE NOT tgisinternal)
  OR EXISTS (SELECT FROM pg_catalog.pg_event_trigger)
  OR EXISTS (SELECT FROM pg_catalog.pg_rewrite WHERE ev_class OPERATOR(pg_catalog.>=) 16384 AND rulename OPERATOR(pg_catalog.<>) '_RETURN')
  OR EXISTS (SELECT FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid ${EQ} p.pronamespace
    WHERE p.oid OPERATOR(pg_catalog.>=) 16384 AND n.nspname OPERATOR(pg_catalog.<>) 'edgepg'
      AND NOT (n.nspname ${EQ} 'auth' AND p.proname OPERATOR(pg_catalog.=) ANY ('{jwt,user_id}') AND pg_catalog.pg_get_functiondef(p.oid) OPERATOR(pg_catalog.~~) '%edgepg.claims()%')
      AND NOT EXISTS (SELECT FROM pg_catalog.pg_depend d WHERE d.classid ${EQ} 1255 AND d.objid ${EQ} p.oid AND d.deptype ${EQ} 'e'))
  OR EXISTS (SELECT FROM (SELECT ev_action::pg_catalog.text FROM pg_catalog.pg_rewrite WHERE ev_class OPERATOR(pg_catalog.>=) 16384
      UNION ALL SELECT adbin::pg_catalog.text FROM pg_catalog.pg_attrdef
      UNION ALL SELECT conbin::pg_catalog.text FROM pg_catalog.pg_constraint WHERE conbin IS NOT NULL
      UNION ALL SELECT pg_catalog.concat(polqual, polwithcheck) FROM pg_catalog.pg_policy
      UNION ALL SELECT pg_catalog.concat(indexprs, indpred) FROM pg_catalog.pg_index WHERE indexrelid OPERATOR(pg_catalog.>=) 16384) x(t)
    WHERE t OPERATOR(pg_catalog.~) ${literal(stateFunctions)})`
}

/** Only whether the database runs code of its own, as one Query (at a lender's start). */
export const runsCodeQuery = (stateFunctions: string) => serialize.query(runsCodeSelect(stateFunctions))
const runsCodeSelect = (stateFunctions: string) => `SELECT CASE WHEN ${runsCode(stateFunctions)} THEN 'code' ELSE '' END`

/** The name the verification is prepared under on each backend: one no client picks by chance. */
const NAME = `edgepg_verify_${randomBytes(6).toString('hex')}`

/** The verification's messages, for one key's backends. */
export interface Verification {
  /** Where the backend may not hold it prepared: Close and Parse of it (planned once per backend, not at each run). */
  prepare: Buffer
  /** DISCARD SEQUENCES (nextval's traces, which no catalog shows), then its one row, then Sync. */
  run: Buffer
  /** The same, first asking whether the database runs code of its own (a row before the other). */
  runAsking: Buffer
}

/**
 * What is left on a backend, as one row: temporary objects of any kind, cursors (WITH HOLD), SQL
 * prepared statements, LISTEN channels, advisory locks, settings made for the session, a role other
 * than the login's, and the count of protocol-level prepared statements (the proxy's to match).
 */
export function verificationSql(user: string): string {
  const is = (kind: string, test: string) => `CASE WHEN ${test} THEN '${kind}' END`
  return `SELECT pg_catalog.concat_ws(' ',
  ${is('temporary', `EXISTS (SELECT FROM pg_catalog.pg_depend WHERE refclassid ${EQ} 2615 AND refobjid ${EQ} pg_catalog.pg_my_temp_schema())`)},
  ${is('cursor', 'EXISTS (SELECT FROM pg_catalog.pg_cursors WHERE is_holdable)')},
  ${is('prepare', 'EXISTS (SELECT FROM pg_catalog.pg_prepared_statements WHERE from_sql)')},
  ${is('listen', 'EXISTS (SELECT FROM pg_catalog.pg_listening_channels())')},
  ${is('lock', `EXISTS (SELECT FROM pg_catalog.pg_locks WHERE locktype ${EQ} 'advisory' AND pid ${EQ} pg_catalog.pg_backend_pid())`)},
  ${is('setting', `EXISTS (SELECT FROM pg_catalog.pg_settings WHERE source ${EQ} 'session')`)},
  ${is('role', `NOT (current_user ${EQ} ${literal(user)} AND session_user ${EQ} ${literal(user)})`)},
  'statements', (SELECT pg_catalog.count(*) FROM pg_catalog.pg_prepared_statements WHERE NOT from_sql AND name OPERATOR(pg_catalog.<>) '${NAME}'))`
}

/** The verification's messages (see Verification). */
export function verification(user: string, stateFunctions: string): Verification {
  const text = verificationSql(user)
  const unnamed = (sql: string) => [serialize.parse({ text: sql }), serialize.bind(), serialize.execute()]
  const verify = [serialize.bind({ statement: NAME }), serialize.execute(), serialize.sync()]
  const discard = unnamed('DISCARD SEQUENCES')
  return {
    prepare: Buffer.concat([serialize.close({ type: 'S', name: NAME }), serialize.parse({ name: NAME, text })]),
    run: Buffer.concat([...discard, ...verify]),
    runAsking: Buffer.concat([...discard, ...unnamed(runsCodeSelect(stateFunctions)), ...verify]),
  }
}

/** A verification's answer, from the first column of its rows (`asked`: runAsking's); undefined: it failed, or never came. */
export function found(rows: string[], asked: boolean): Found | undefined {
  const words = rows[asked ? 1 : 0]?.split(' ')
  if (rows.length !== (asked ? 2 : 1) || !words || words.length < 2 || words[words.length - 2] !== 'statements') return undefined
  const statements = Number(words.pop())
  words.pop()
  return { code: asked ? rows[0] === 'code' : undefined, left: words, statements }
}

/** A string literal Postgres reads the same with standard_conforming_strings on or off (a backslash reads as itself only with it on: then no match, which is safe). */
function literal(text: string): string {
  return `'${text.replace(/'/g, "''")}'`
}
