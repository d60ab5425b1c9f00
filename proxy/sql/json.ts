/**
 * JSON for POST /sql's responses: errors with every field Neon's protocol carries, and Neon's
 * conversion of text values when raw text output is not asked for.
 */
import type { DatabaseError } from 'pg-protocol'

/** The DatabaseError fields an error response carries besides `message`, in Neon's order. */
export const ERROR_FIELDS = [
  'code', 'detail', 'hint', 'position', 'internalPosition', 'internalQuery', 'severity', 'where',
  'table', 'column', 'schema', 'dataType', 'constraint', 'file', 'line', 'routine',
] as const

export function errorJson(message: string, code: string | null = null): string {
  const out: Record<string, unknown> = { message, code }
  for (const f of ERROR_FIELDS) if (f !== 'code') out[f] = null
  return JSON.stringify(out)
}

export function databaseErrorJson(err: DatabaseError): string {
  const out: Record<string, unknown> = { message: err.message }
  for (const f of ERROR_FIELDS) out[f] = (err as any)[f] ?? null
  return JSON.stringify(out)
}

// ── non-raw output (Neon's conversion of text values to JSON) ────────────────────────────────

/** Types whose text Neon's server turns into JSON values; arrays of them are learnt per database. */
export const OID = { bool: 16, int2: 21, int4: 23, float4: 700, float8: 701, json: 114, jsonb: 3802 }

/** An array type: its element type and delimiter. */
export interface ArrayType {
  elem: number
  delim: string
}

const JSON_NUMBER = /^-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?$/

export function textToJson(text: string, oid: number, types: Map<number, ArrayType | null>): string {
  const array = types.get(oid)
  if (array) return arrayToJson(text, array, types) ?? JSON.stringify(text)
  switch (oid) {
    case OID.bool:
      return text === 't' ? 'true' : 'false'
    case OID.int2:
    case OID.int4:
      return JSON_NUMBER.test(text) ? text : JSON.stringify(text)
    case OID.float4:
    case OID.float8: {
      if (JSON_NUMBER.test(text)) return text
      const n = Number(text)
      return Number.isFinite(n) ? JSON.stringify(n) : JSON.stringify(text) // NaN, Infinity stay text
    }
    case OID.json:
    case OID.jsonb:
      return text
    default:
      return JSON.stringify(text)
  }
}

/** An array's text form as a JSON array (nested for more dimensions); undefined if it is not one. */
function arrayToJson(text: string, type: ArrayType, types: Map<number, ArrayType | null>): string | undefined {
  let s = text
  if (s.startsWith('[')) {
    const eq = s.indexOf('=') // dimension decoration: [1:2]={...}
    if (eq < 0) return undefined
    s = s.slice(eq + 1)
  }
  let at = 0
  const ws = () => {
    while (at < s.length && /\s/.test(s[at])) at++
  }
  const element = (item: string) => textToJson(item, type.elem, types)
  const list = (): string | undefined => {
    if (s[at] !== '{') return undefined
    at++
    const out: string[] = []
    ws()
    if (s[at] === '}') {
      at++
      return '[]'
    }
    for (;;) {
      ws()
      if (s[at] === '{') {
        const inner = list()
        if (inner === undefined) return undefined
        out.push(inner)
      } else if (s[at] === '"') {
        at++
        let item = ''
        for (;;) {
          if (at >= s.length) return undefined
          const c = s[at++]
          if (c === '"') break
          item += c === '\\' ? s[at++] ?? '' : c
        }
        out.push(element(item))
      } else {
        let end = at
        while (end < s.length && s[end] !== type.delim && s[end] !== '}') end++
        if (end >= s.length) return undefined
        const item = s.slice(at, end).trim()
        at = end
        out.push(item === 'NULL' ? 'null' : element(item))
      }
      ws()
      if (s[at] === type.delim) {
        at++
        continue
      }
      if (s[at] !== '}') return undefined
      at++
      return '[' + out.join(',') + ']'
    }
  }
  ws()
  const json = list()
  ws()
  return json !== undefined && at === s.length ? json : undefined
}
