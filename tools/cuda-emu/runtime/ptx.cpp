// A reader of the few facts of a PTX module the emulated driver checks launches against (see ptx.h). PTX is
// line-oriented text from nvcc; this reads declarations and function bodies, not instructions.

#include "ptx.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <regex>
#include <set>

namespace emu {
namespace {

// `text` without // and /* */ comments.
std::string strip_comments(const std::string &text) {
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
        if (text.compare(i, 2, "//") == 0) {
            while (i < text.size() && text[i] != '\n') ++i;
        } else if (text.compare(i, 2, "/*") == 0) {
            const size_t end = text.find("*/", i + 2);
            i = end == std::string::npos ? text.size() : end + 2;
        } else if (text[i] == '"') {
            // Strings (in `.file` directives) are kept whole.
            const size_t end = text.find('"', i + 1);
            const size_t stop = end == std::string::npos ? text.size() : end + 1;
            out.append(text, i, stop - i);
            i = stop;
        } else {
            out += text[i++];
        }
    }
    return out;
}

// Bytes of a PTX scalar type (`.u64`, `.f32`, `.b8`, …).
size_t type_size(const std::string &type) {
    static const std::map<std::string, size_t> sizes = {
        {".u8", 1},  {".s8", 1},  {".b8", 1},  {".u16", 2}, {".s16", 2}, {".b16", 2}, {".f16", 2},
        {".bf16", 2}, {".u32", 4}, {".s32", 4}, {".b32", 4}, {".f32", 4}, {".u64", 8}, {".s64", 8},
        {".b64", 8}, {".f64", 8}, {".pred", 1}};
    auto it = sizes.find(type);
    return it == sizes.end() ? 0 : it->second;
}

struct SharedVar {
    size_t size, align;
    size_t order;
};

struct Function {
    std::string name;
    bool entry;
    std::string params, directives, body;
};

// The identifiers of `body` (PTX names may hold `$` and start with `%` or `_`).
std::set<std::string> identifiers(const std::string &body) {
    std::set<std::string> out;
    for (size_t i = 0; i < body.size();) {
        const char c = body[i];
        if (isalpha((unsigned char)c) || c == '_' || c == '$' || c == '%') {
            size_t j = i + 1;
            while (j < body.size() && (isalnum((unsigned char)body[j]) || body[j] == '_' || body[j] == '$')) ++j;
            out.insert(body.substr(i, j - i));
            i = j;
        } else {
            ++i;
        }
    }
    return out;
}

}  // namespace

bool parse_ptx(const std::string &raw, PtxModule *out, std::string *error) {
    const std::string text = strip_comments(raw);
    std::smatch m;
    static const std::regex version(R"(\.version\s+(\d+)\.(\d+))");
    static const std::regex target(R"(\.target\s+sm_(\d+))");
    if (!std::regex_search(text, m, version)) {
        *error = "no .version directive: not PTX text";
        return false;
    }
    out->isa_major = std::stoi(m[1]);
    out->isa_minor = std::stoi(m[2]);
    if (std::regex_search(text, m, target)) out->target = std::stoi(m[1]);

    // Static shared variables, wherever declared: `.shared [.align A] .type name[N];`.
    std::map<std::string, SharedVar> shared;
    static const std::regex shared_decl(R"(^\.shared\s+(?:\.align\s+(\d+)\s+)?(\.\w+)\s+([A-Za-z_$][\w$]*)\s*(\[\s*(\d*)\s*\])?)");
    size_t order = 0;
    for (size_t at = text.find(".shared"); at != std::string::npos; at = text.find(".shared", at + 7)) {
        // `.extern .shared … x[]` is the dynamic shared memory, sized at launch; `ld.shared` is an instruction.
        const size_t line = text.rfind('\n', at) == std::string::npos ? 0 : text.rfind('\n', at) + 1;
        const std::string before = text.substr(line, at - line);
        if (before.find_first_not_of(" \t") != std::string::npos) continue;
        const std::string decl = text.substr(at, text.find(';', at) - at);
        std::smatch d;
        if (!std::regex_search(decl, d, shared_decl)) continue;
        const size_t element = type_size(d[2]);
        const size_t count = d[4].matched ? (d[5].length() ? std::stoull(d[5]) : 0) : 1;
        const size_t align = d[1].matched ? std::stoull(d[1]) : element;
        shared[d[3]] = SharedVar{element * count, align ? align : 1, order++};
    }

    // Functions: `… .entry|.func [(ret)] name [(params)] directives { body }` (or `;` for a declaration).
    std::vector<Function> functions;
    for (size_t at = 0;;) {
        const size_t e = text.find(".entry", at), fn = text.find(".func", at);
        const size_t kw = std::min(e, fn);
        if (kw == std::string::npos) break;
        Function f;
        f.entry = kw == e;
        size_t i = kw + (f.entry ? 6 : 5);
        auto skip_space = [&] { while (i < text.size() && isspace((unsigned char)text[i])) ++i; };
        auto group = [&](std::string *into) {  // a parenthesized list at i, if any
            skip_space();
            if (i >= text.size() || text[i] != '(') return true;
            const size_t close = text.find(')', i);
            if (close == std::string::npos) return false;
            if (into) *into = text.substr(i + 1, close - i - 1);
            i = close + 1;
            return true;
        };
        if (!f.entry && !group(nullptr)) break;  // a .func's return value
        skip_space();
        const size_t name_start = i;
        while (i < text.size() && (isalnum((unsigned char)text[i]) || text[i] == '_' || text[i] == '$')) ++i;
        f.name = text.substr(name_start, i - name_start);
        if (f.name.empty() || !group(&f.params)) {
            *error = "cannot read the function declared at byte " + std::to_string(kw);
            return false;
        }
        const size_t brace = text.find_first_of("{;", i);
        if (brace == std::string::npos) {
            *error = "no body for " + f.name;
            return false;
        }
        f.directives = text.substr(i, brace - i);
        if (text[brace] == ';') {
            at = brace + 1;
            continue;
        }
        int depth = 0;
        size_t j = brace;
        for (; j < text.size(); ++j) {
            if (text[j] == '{') ++depth;
            else if (text[j] == '}' && --depth == 0) break;
        }
        if (j >= text.size()) {
            *error = "unterminated body of " + f.name;
            return false;
        }
        f.body = text.substr(brace, j + 1 - brace);
        functions.push_back(std::move(f));
        at = j + 1;
    }

    std::map<std::string, const Function *> by_name;
    for (const Function &f : functions) by_name[f.name] = &f;
    static const std::regex param(R"(\.param\s+(?:\.align\s+\d+\s+)?(\.\w+)(?:\s+\.ptr(?:\s+\.\w+)*(?:\s+\.align\s+\d+)?)?\s+[A-Za-z_$][\w$]*\s*(\[\s*(\d+)\s*\])?)");
    static const std::regex maxntid(R"(\.maxntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?)");
    for (const Function &f : functions) {
        if (!f.entry) continue;
        PtxEntry e;
        e.name = f.name;
        for (std::sregex_iterator it(f.params.begin(), f.params.end(), param), end; it != end; ++it) {
            const size_t element = type_size((*it)[1]);
            const size_t count = (*it)[2].matched ? std::stoull((*it)[3]) : 1;
            e.param_sizes.push_back(element * count);
        }
        std::smatch mt;
        if (std::regex_search(f.directives, mt, maxntid)) {
            e.max_threads = (unsigned)std::stoul(mt[1]);
            if (mt[2].matched) e.max_threads *= (unsigned)std::stoul(mt[2]);
            if (mt[3].matched) e.max_threads *= (unsigned)std::stoul(mt[3]);
        }
        // The shared variables of the entry and of every function it calls, transitively.
        std::set<std::string> seen{f.name}, used;
        std::vector<const Function *> todo{&f};
        while (!todo.empty()) {
            const Function *g = todo.back();
            todo.pop_back();
            for (const std::string &id : identifiers(g->body)) {
                if (shared.count(id)) used.insert(id);
                auto callee = by_name.find(id);
                if (callee != by_name.end() && seen.insert(id).second) todo.push_back(callee->second);
            }
        }
        std::vector<std::pair<size_t, std::string>> in_order;
        for (const std::string &name : used) in_order.push_back({shared[name].order, name});
        std::sort(in_order.begin(), in_order.end());
        size_t bytes = 0;
        for (const auto &entry : in_order) {
            const SharedVar &v = shared[entry.second];
            bytes = (bytes + v.align - 1) / v.align * v.align + v.size;
        }
        e.static_shared = bytes;
        out->entries.push_back(e);
    }
    return true;
}

}  // namespace emu
